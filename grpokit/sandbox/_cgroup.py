"""One cgroup per sandboxed run: a memory budget for all of its processes and all kinds of memory, and a
process budget.

cgroup v2 (`memory.max`, `memory.swap.max=0`, `memory.oom.group=1`, `pids.max`) is used when this process's
cgroup has the memory and pids controllers enabled for its children (or is the root of the hierarchy, where
they can be enabled); otherwise cgroup v1 (`memory.limit_in_bytes`, `memory.memsw.limit_in_bytes`, `pids.max`)
when both controllers are mounted and this process may create cgroups under its own. Run cgroups are created
below this process's own cgroup(s), so every limit the machine puts on the trainer still holds; they are named
`grpokit-<pid>-<n>` and removed after the run (the processes left are killed first). Cgroups of a trainer that
died without removing them are removed by the next trainer that sets up (see `_sweep_stale`).

Kernel memory (page tables, pipe buffers, socket buffers) is counted too where the kernel accounts it to the
cgroup (v2 always; v1 on kernels that account kmem, as 5.x+ do by default). Page cache of read files counts,
and is reclaimed before anything is killed.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("grpokit.sandbox")

NAME_PREFIX = "grpokit-"
_COUNTER = itertools.count()
_COUNTER_LOCK = threading.Lock()


@dataclass(frozen=True)
class CgroupParents:
    """Where run cgroups go: v2: {"unified": dir}; v1: {"memory": dir, "pids": dir}."""

    version: int
    parents: dict[str, str]


def _mounts() -> dict[str, str]:
    """Mount points: "cgroup2" -> path, and each v1 controller name -> path."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(rest) < 3:
                    continue
                point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                if rest[0] == "cgroup2":
                    found.setdefault("cgroup2", point)
                elif rest[0] == "cgroup":
                    for option in rest[2].split(","):
                        if option in ("memory", "pids"):
                            found.setdefault(option, point)
    except OSError:
        pass
    return found


def _own_paths() -> dict[str, str]:
    """This process's cgroup paths: "" -> the v2 path, and each v1 controller -> its path."""
    paths: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as fh:
            for line in fh:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                for controller in controllers.split(","):
                    paths[controller] = path
    except OSError:
        pass
    return paths


def _read(path: str) -> str:
    with open(path, encoding="ascii") as fh:
        return fh.read()


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as fh:
        fh.write(value)


def _writable_dir(parent: str) -> bool:
    """Can we create (and remove) a cgroup under `parent`?"""
    probe = os.path.join(parent, f"{NAME_PREFIX}{os.getpid()}-probe")
    try:
        os.mkdir(probe)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        return False
    return True


def find_parents() -> CgroupParents | None:
    """Where this process may create run cgroups with memory and pids control, or None."""
    mounts, own = _mounts(), _own_paths()
    if "cgroup2" in mounts and "" in own:
        base = os.path.join(mounts["cgroup2"], own[""].lstrip("/"))
        try:
            enabled = _read(os.path.join(base, "cgroup.subtree_control")).split()
            available = _read(os.path.join(base, "cgroup.controllers")).split()
            if not {"memory", "pids"} <= set(enabled) and own[""] == "/" and {"memory", "pids"} <= set(available):
                # The root of the hierarchy may hold processes and enable controllers for its children.
                _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
                enabled = _read(os.path.join(base, "cgroup.subtree_control")).split()
            if {"memory", "pids"} <= set(enabled) and _writable_dir(base):
                return CgroupParents(2, {"unified": base})
        except OSError:
            pass
    if "memory" in mounts and "pids" in mounts and "memory" in own and "pids" in own:
        parents = {c: os.path.join(mounts[c], own[c].lstrip("/")) for c in ("memory", "pids")}
        if all(_writable_dir(p) for p in parents.values()):
            return CgroupParents(1, parents)
    return None


def _procs(directory: str) -> list[int]:
    try:
        return [int(p) for p in _read(os.path.join(directory, "cgroup.procs")).split()]
    except (OSError, ValueError):
        return []


def _empty_and_remove(directory: str, seconds: float) -> bool:
    """SIGKILL every process in `directory` until none is left, then rmdir it. False if it stays."""
    deadline = time.monotonic() + seconds
    while True:
        kill_file = os.path.join(directory, "cgroup.kill")
        if os.path.exists(kill_file):
            try:
                _write(kill_file, "1")
            except OSError:
                pass
        for pid in _procs(directory):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def _sweep_stale(parents: CgroupParents) -> None:
    """Remove run cgroups left by trainers that died (their pid is gone)."""
    for parent in parents.parents.values():
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            match = re.fullmatch(rf"{NAME_PREFIX}(\d+)-\d+", name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(match.group(1)), 0)
                continue  # its trainer is alive
            except ProcessLookupError:
                pass
            except OSError:
                continue
            if _empty_and_remove(os.path.join(parent, name), 1.0):
                logger.info("removed the sandbox cgroup %s left by a process that died", name)


class RunCgroup:
    """The cgroup(s) of one run. Create with `create`, always `remove` (it kills what is left)."""

    def __init__(self, parents: CgroupParents, memory_bytes: int, max_tasks: int) -> None:
        with _COUNTER_LOCK:
            name = f"{NAME_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.version = parents.version
        self.dirs = {key: os.path.join(parent, name) for key, parent in parents.parents.items()}
        self.memory_bytes = memory_bytes
        created = []
        try:
            for directory in self.dirs.values():
                os.mkdir(directory)
                created.append(directory)
            if self.version == 2:
                d = self.dirs["unified"]
                _write(os.path.join(d, "memory.max"), str(memory_bytes))
                for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    try:  # absent without swap accounting / on kernels before 4.19
                        _write(os.path.join(d, name), value)
                    except OSError:
                        pass
                _write(os.path.join(d, "pids.max"), str(max_tasks))
            else:
                m = self.dirs["memory"]
                _write(os.path.join(m, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(m, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(m, "memory.memsw.limit_in_bytes"), str(memory_bytes))  # no swap either
                _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_tasks))
        except BaseException:
            for directory in created:
                _empty_and_remove(directory, 0.5)
            raise

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def _memory_dir(self) -> str:
        return self.dirs["unified" if self.version == 2 else "memory"]

    def oom_kills(self) -> int:
        """How many processes the kernel killed for passing the budget."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = _read(os.path.join(self._memory_dir(), name))
        except OSError:
            return 0
        match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self._memory_dir(), name)))
        except (OSError, ValueError):
            return None

    def remove(self) -> bool:
        """Kill every process left and remove the cgroup(s); False (and a warning) if one could not be removed."""
        ok = True
        for directory in self.dirs.values():
            if not _empty_and_remove(directory, 2.0):
                ok = False
                logger.warning("could not remove the sandbox cgroup %s; the next trainer will retry", directory)
        return ok


_PARENTS_LOCK = threading.Lock()
_PARENTS: dict[str, CgroupParents | None] = {}


def parents() -> CgroupParents | None:
    """`find_parents()` once per process, with a sweep of stale run cgroups the first time."""
    with _PARENTS_LOCK:
        if "found" not in _PARENTS:
            found = find_parents()
            if found is not None:
                _sweep_stale(found)
            _PARENTS["found"] = found
        return _PARENTS["found"]

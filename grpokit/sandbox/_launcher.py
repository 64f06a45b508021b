"""Starting one run: a uid slot, a fresh workdir and cgroup, then the init (`_boot.py`) behind `unshare`
(network, pid, mount and IPC namespaces) with the rlimits, uid drop and seccomp filter it applies."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

from grpokit.sandbox import _cgroup
from grpokit.sandbox._cgroup import RunCgroup
from grpokit.sandbox._config import SandboxConfig
from grpokit.sandbox._process_tree import _kill_tree
from grpokit.sandbox._result import SandboxResult
from grpokit.sandbox._supervisor import _supervise
from grpokit.sandbox._uid_slots import _SLOTS

BOOT_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_boot.py")
WORKDIR_PREFIX = "grpokit-sbx-"
PROGRAM_NAME = "main.py"
MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
_PAGE = 4096  # a tmpfs file takes whole pages


@dataclass(frozen=True)
class _LaunchMode:
    """One way of starting the init process; the detection picks the strongest that works here."""

    namespaces: bool
    user_namespace: bool
    drop_privileges: bool
    read_only_filesystem: bool
    seccomp: bool = True
    cgroup: bool = True

    def unshare_args(self) -> list[str]:
        if not self.namespaces:
            return []
        args = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc"]
        if self.user_namespace:
            args += ["--user", "--map-root-user"]
        return args


def _clean_env(workdir: str) -> dict[str, str]:
    return {"PATH": MINIMAL_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _rlimits(config: SandboxConfig, limit_processes: bool) -> list[tuple[str, int, int]]:
    limits = [
        ("RLIMIT_CPU", config.cpu_seconds, config.cpu_seconds + 1),
        ("RLIMIT_AS", config.memory_bytes, config.memory_bytes),
        ("RLIMIT_FSIZE", config.file_size_bytes, config.file_size_bytes),
        ("RLIMIT_NOFILE", config.max_open_files, config.max_open_files),
        ("RLIMIT_CORE", 0, 0),
    ]
    if limit_processes:
        limits.append(("RLIMIT_NPROC", config.max_processes, config.max_processes))
    return limits


def _boot_spec(
    config: SandboxConfig, mode: _LaunchMode, python: str, uid: int | None, workdir: str, status_fd: int,
    cgroup: RunCgroup | None,
) -> dict:
    """What the init (`_boot.py`) needs to know, as JSON-ready data."""
    return {
        "status_fd": status_fd,
        "workdir": workdir,
        "program": PROGRAM_NAME,
        "read_only_root": mode.read_only_filesystem,
        "private_workdir": mode.read_only_filesystem,
        "disk_bytes": config.disk_bytes,
        "max_files": config.max_files,
        "uid": uid,
        "gid": uid,
        "rlimits": _rlimits(config, limit_processes=mode.drop_privileges or os.geteuid() != 0),
        "argv": [python, "-I", "-B", os.path.join(workdir, PROGRAM_NAME)],
        "env": _clean_env(workdir),
        "seccomp": mode.seccomp,
        "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
    }


def _too_large(code: str, config: SandboxConfig, mode: _LaunchMode) -> SandboxResult | None:
    """A program that cannot fit the run's tmpfs is the program's failure ("error"), not the sandbox's: it would
    otherwise fail the init's setup and be scored None, which a policy could reach by writing a huge program."""
    size = len(code.encode("utf-8", errors="surrogatepass"))
    if not mode.read_only_filesystem or size <= config.disk_bytes - _PAGE:
        return None
    message = (f"the program ({size} bytes) does not fit the run's private disk (SandboxConfig.disk_bytes="
               f"{config.disk_bytes}); raise disk_bytes to run programs this large")
    return SandboxResult("error", None, "", message, 0.0, "program_size")


def _launch(code: str, stdin: str, config: SandboxConfig, mode: _LaunchMode, python: str) -> SandboxResult:
    """One run under `mode`: take a uid slot, a fresh workdir and cgroup, run, then give them all back."""
    too_large = _too_large(code, config, mode)
    if too_large is not None:
        return too_large
    start = time.monotonic()
    slot = _SLOTS.acquire(config.uid_base) if mode.drop_privileges else None
    try:
        workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
        try:
            # surrogatepass: a lone surrogate is written as its (invalid UTF-8) bytes, so the program fails to
            # compile, as that source would; the sandbox itself never raises on it
            with open(os.path.join(workdir, PROGRAM_NAME), "w", encoding="utf-8", errors="surrogatepass") as fh:
                fh.write(code)
            uid = config.uid_base + slot if slot is not None else None
            cgroup = None
            if mode.cgroup:
                parents = _cgroup.parents()
                if parents is None:
                    raise OSError("the run's cgroup cannot be created: no writable memory+pids cgroup any more")
                # +1 task: the init, which joins the cgroup before it starts the program
                cgroup = RunCgroup(parents, config.memory_bytes, config.max_processes + 1)
            try:
                return _start(stdin, config, mode, python, uid, workdir, start, cgroup)
            finally:
                if cgroup is not None:
                    cgroup.remove()
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    finally:
        if slot is not None:
            _SLOTS.release(slot)


def _start(
    stdin: str, config: SandboxConfig, mode: _LaunchMode, python: str, uid: int | None, workdir: str, start: float,
    cgroup: RunCgroup | None,
) -> SandboxResult:
    """Start the init with a private status pipe, supervise the run, and never leave a process behind."""
    status_r, status_w = os.pipe()
    proc = None
    try:
        spec = _boot_spec(config, mode, python, uid, workdir, status_w, cgroup)
        argv = mode.unshare_args() + [python, "-I", "-S", BOOT_SCRIPT, json.dumps(spec)]
        try:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env={"PATH": MINIMAL_PATH}, cwd="/", start_new_session=True, pass_fds=(status_w,),
            )
        except OSError as exc:
            return SandboxResult("infra_error", None, "", f"could not start the sandbox: {exc}", 0.0, "setup")
        finally:
            os.close(status_w)
        return _supervise(proc, stdin.encode("utf-8", errors="surrogatepass"), config, (mode, uid, python), status_r,
                          start, cgroup)
    finally:
        if proc is not None and proc.poll() is None:  # only after an unexpected error in _supervise
            _kill_tree(proc, mode, uid, python)
            proc.wait()
        os.close(status_r)

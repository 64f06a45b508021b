"""What a run uses and what the host takes from it, read from /proc while it runs.

`tree_usage`: the CPU time of all of the run's processes together (the supervisor kills the run past its CPU
budget, so forking busy children buys no CPU), whether one of them is stopped, and how long each of its threads
has waited for a CPU. `_StallMeter`: the wall time the host takes from the run; the supervisor moves the run's
deadline by this much, and past `SandboxConfig.max_host_stall_seconds` the run is "infra_error" (unknown), so a
loaded or frozen machine never scores a program 0.

The line between the host and the program: the sandbox owes a run one CPU. Time the program's main thread waits
for a CPU is the host's only beyond what the run's other threads and processes used or waited for meanwhile (a
program that keeps several tasks runnable competes with itself, however loaded the machine). Stops are the
host's because the program cannot stop itself: the seccomp filter refuses stop signals, ptrace, and every way to
have the kernel send a stop signal for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from grpokit.sandbox._process_tree import _children

_SCHEDSTAT = os.path.exists("/proc/self/schedstat")  # per-task CPU and run-queue wait (CONFIG_SCHED_INFO)

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime + cutime + cstime of a process (its threads, dead ones included, and reaped children)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return sum(int(f) for f in fields[11:15]) / _CLOCK_TICKS


def _schedstat(pid: int, tid: int) -> tuple[float, float] | None:
    """(CPU seconds, seconds waited runnable for a CPU) of one thread."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as fh:
            run_ns, wait_ns, _ = fh.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


@dataclass
class TreeUsage:
    """One reading of a run's process tree."""

    cpu: float = 0.0  # CPU seconds of every process, itself, its threads and its reaped children included
    stopped: bool = False  # one of its threads is stopped (state T or t)
    waits: dict[int, float] = field(default_factory=dict)  # thread id -> seconds it waited runnable for a CPU


def _read_thread(pid: int, tid: str, usage: TreeUsage) -> list[int]:
    """Add one thread's state and wait to `usage`; return its children."""
    try:
        with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        usage.stopped |= state in (b"T", b"t")
        stat = _schedstat(pid, int(tid)) if _SCHEDSTAT else None
        if stat is not None:
            usage.waits[int(tid)] = stat[1]
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
            return [int(c) for c in fh.read().split()]
    except (OSError, IndexError, ValueError):
        return []


def tree_usage(root: int) -> TreeUsage:
    """Read every process under `root` (itself included) from /proc."""
    usage, seen = TreeUsage(), set()
    stack = [(root, False)]
    while stack:  # post-order: a process is read after its children, so a child reaped meanwhile still counts
        pid, expanded = stack.pop()
        if expanded:
            usage.cpu += _proc_cpu_seconds(pid) or 0.0
            continue
        if pid in seen:
            continue
        seen.add(pid)
        stack.append((pid, True))
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stack += [(child, False) for child in _read_thread(pid, tid, usage)]
    return usage


class _StallMeter:
    """How much wall time the host has taken from a run, sampled from /proc while it runs.

    Taken in an interval: all of it when one of the run's threads is stopped (only something outside can stop
    one), else the time the program's main thread waited runnable for a CPU (/proc/<pid>/task/<pid>/schedstat)
    minus the CPU time the run's other threads and processes used and the time they waited for a CPU meanwhile
    (its own tasks cannot make it look starved). The filter also refuses nice/priority/affinity changes, which
    would make a program wait longer on purpose.
    """

    def __init__(self, root_pid: int, namespaces: bool) -> None:
        self.root = root_pid
        self.namespaces = namespaces
        self.program: int | None = None
        self.last: tuple[float, float, float, TreeUsage, int] | None = None  # (time, wait, cpu, usage, pid)
        self.stolen = 0.0

    def _launcher_chain(self) -> tuple[int | None, int | None]:
        init = self.root
        if self.namespaces:
            kids = _children(self.root)
            init = kids[0] if kids else None
        if self.program is None and init is not None:
            kids = _children(init)
            self.program = kids[0] if kids else None
        return init, self.program

    def sample(self, now: float, usage: TreeUsage) -> float:
        """Update and return the total taken so far, given `tree_usage` of the run's root now."""
        init, program = self._launcher_chain()
        watched = program if program is not None else init
        stat = _schedstat(watched, watched) if watched is not None else None
        if stat is None:
            return self.stolen
        own_cpu, wait = stat
        if self.last is not None and self.last[4] == watched:
            last_time, last_wait, last_cpu, last_usage, _ = self.last
            if usage.stopped:
                self.stolen += now - last_time
            else:
                others_cpu = max(0.0, (usage.cpu - last_usage.cpu) - (own_cpu - last_cpu))
                others_wait = sum(max(0.0, w - last_usage.waits.get(tid, 0.0))
                                  for tid, w in usage.waits.items() if tid != watched)
                self.stolen += max(0.0, (wait - last_wait) - others_cpu - others_wait)
        self.last = (now, wait, own_cpu, usage, watched)
        return self.stolen

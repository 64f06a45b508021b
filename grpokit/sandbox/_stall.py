"""Host-stall accounting: the wall time the host takes from a run, read from /proc while it runs.

The supervisor moves the run's deadline by this much; past `SandboxConfig.max_host_stall_seconds` the run is
"infra_error" (unknown), so a loaded or frozen machine never scores a program 0.
"""

from __future__ import annotations

import os

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


class _StallMeter:
    """How much wall time the host has taken from a run, sampled from /proc while it runs.

    Taken in an interval: all of it when one of the run's processes is stopped (SIGSTOP/SIGTSTP from outside:
    the seccomp filter refuses stop signals to the program, and ptrace, so it cannot stop itself), else the
    time the program's main thread waited runnable for a CPU (/proc/<pid>/schedstat) minus the CPU time the
    run's other processes and threads used meanwhile (its own children cannot make it look starved). The
    filter also refuses nice/priority/affinity changes, which would make a program wait longer on purpose.
    """

    def __init__(self, root_pid: int, namespaces: bool) -> None:
        self.root = root_pid
        self.namespaces = namespaces
        self.program: int | None = None
        self.last: tuple[float, float, float, float, int] | None = None  # (time, wait, cpu, tree cpu, pid)
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

    def _tree(self) -> tuple[float, bool]:
        """(CPU seconds of every live process under the root, reaped ones included; whether one is stopped)."""
        total, stopped, seen = 0.0, False, set()
        stack = [(self.root, False)]
        while stack:  # post-order: a process is read after its children, so a child reaped meanwhile still counts
            pid, expanded = stack.pop()
            if expanded:
                total += _proc_cpu_seconds(pid) or 0.0
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
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                        state = fh.read().rsplit(b")", 1)[1].split()[0]
                    stopped |= state in (b"T", b"t")
                    with open(f"/proc/{pid}/task/{tid}/children", "rb") as fh:
                        stack += [(int(c), False) for c in fh.read().split()]
                except (OSError, IndexError, ValueError):
                    continue
        return total, stopped

    @staticmethod
    def _schedstat(pid: int) -> tuple[float, float] | None:
        """(CPU seconds, runnable-wait seconds) of the main thread of `pid`."""
        try:
            with open(f"/proc/{pid}/task/{pid}/schedstat", "rb") as fh:
                run_ns, wait_ns, _ = fh.read().split()
            return int(run_ns) / 1e9, int(wait_ns) / 1e9
        except (OSError, ValueError):
            return None

    def sample(self, now: float) -> float:
        """Update and return the total taken so far."""
        init, program = self._launcher_chain()
        watched = program if program is not None else init
        stat = self._schedstat(watched) if watched is not None else None
        tree_cpu, stopped = self._tree()
        if stat is None:
            return self.stolen
        own_cpu, wait = stat
        if self.last is not None and self.last[4] == watched:
            dt = now - self.last[0]
            if stopped:
                self.stolen += dt
            else:
                others = max(0.0, (tree_cpu - self.last[3]) - (own_cpu - self.last[2]))
                self.stolen += max(0.0, (wait - self.last[1]) - others)
        self.last = (now, wait, own_cpu, tree_cpu, watched)
        return self.stolen

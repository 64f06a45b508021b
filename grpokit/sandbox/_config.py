"""The limits of one sandboxed run (`SandboxConfig`) and their checks.

Every numeric field declares its bounds beside its default (`_limit`); `SandboxConfig.__post_init__` checks every
field against them at construction and names the field, the value, the allowed range, what the bound protects and
the fix. The bounds are wider than any real run and refuse what would remove a protection (a limit of inf, uid 0)
or void every verdict (a tmpfs too small for the program, an output cap too small for the judge's record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

KiB, MiB, GiB = 1024, 1024**2, 1024**3
UID_SLOTS = 65536  # uids a uid_base reserves: uid_base + slot, slot < UID_SLOTS (_uid_slots.py)


@dataclass(frozen=True)
class Bounds:
    """The values a numeric field accepts: an int (kind int) or a finite int/float (kind float) from `low` to
    `high`, both included (low excluded when `low_open`); None too when `none_ok`. `why` says what they protect."""

    kind: type
    low: float
    high: float
    why: str
    low_open: bool = False
    none_ok: bool = False
    sizes: bool = False  # a number of bytes: the message adds KiB/MiB/GiB

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        span = f"{'(' if self.low_open else '['}{_number(self.low, self.sizes)}, {_number(self.high, self.sizes)}]"
        return f"{'None or ' if self.none_ok else ''}{what} in {span}"

    def accepts(self, value: object) -> bool:
        if value is None:
            return self.none_ok
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if not math.isfinite(value):
            return False
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high


def _number(value: float, sizes: bool) -> str:
    """65536 -> '65536', 33554432 -> '33554432 (32 MiB)' (sizes), 0.5 -> '0.5'."""
    if not float(value).is_integer():
        return repr(value)
    value = int(value)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if sizes and value >= size and value % size == 0:
            return f"{value} ({value // size} {unit})"
    return str(value)


def _limit(default: float | None, bounds: Bounds) -> Any:
    """A dataclass field with its bounds (read by `SandboxConfig.__post_init__`)."""
    return field(default=default, metadata={"bounds": bounds})


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed run. Every limit applies to each run separately."""

    timeout_seconds: float = _limit(10.0, Bounds(
        float, 0, 3600, "The wall-clock limit of one run: past an hour (or inf) a program holds a worker for good.",
        low_open=True))
    """Wall-clock limit; the whole process tree is killed when it passes (status "timeout")."""
    cpu_seconds: int = _limit(5, Bounds(int, 1, 3600, "The CPU time of one run, all of its processes together."))
    """CPU time of the whole run, all of its processes and threads together (read every 0.05 s: past it the run
    is killed, status "killed", reason "cpu"); also RLIMIT_CPU per process (soft; SIGXCPU at the soft limit,
    SIGKILL one second later). A program that forks busy children spends one budget, not one per child."""
    memory_bytes: int = _limit(512 * MiB, Bounds(
        int, 32 * MiB, 64 * GiB, "Python needs about 30 MB to start; above 64 GiB the budget protects no machine.",
        sizes=True))
    """The run's memory budget. Where a cgroup is available (`sandbox_protections()["memory_budget"]`): one
    budget for all of the run's processes and all kinds of memory (anonymous, tmpfs/shm files, kernel buffers),
    past which the run is killed (status "killed", reason "memory"). Also RLIMIT_AS per process (a single
    process gets MemoryError first). Without a cgroup only the per-process limit holds: see docs/rewards.md for
    the bound. Python itself needs about 30 MB; numpy/torch imports much more."""
    file_size_bytes: int = _limit(16 * MiB, Bounds(int, 1, 64 * GiB, "The largest file one run may write.", sizes=True))
    """RLIMIT_FSIZE: the largest file the program may write."""
    disk_bytes: int = _limit(64 * MiB, Bounds(
        int, 1 * MiB, 64 * GiB, "The run's tmpfs holds the program itself: below 1 MiB programs no longer fit and "
        "every run fails to start (scored None).", sizes=True))
    """Size of the private tmpfs working directory (only where a mount namespace is available)."""
    max_files: int = _limit(1024, Bounds(int, 16, 2**20, "Inodes of the run's tmpfs (the program file is one)."))
    """Inodes of that tmpfs: files + directories the program may create."""
    max_processes: int = _limit(16, Bounds(int, 1, 4096, "Processes and threads of one run."))
    """Processes + threads of the run: the cgroup's pids.max (plus one for the init) where there is a cgroup, and
    RLIMIT_NPROC for the run's own uid (not enforced for root). Without the uid drop (a non-root caller) the
    kernel counts every process of the caller's uid against RLIMIT_NPROC."""
    max_open_files: int = _limit(256, Bounds(int, 16, 65536, "Python needs a few descriptors to start."))
    """RLIMIT_NOFILE."""
    max_output_bytes: int = _limit(1 * MiB, Bounds(
        int, 4 * KiB, 8 * MiB, "The trainer holds up to twice this per run (stdout and stderr) for every run of a "
        "batch: 8 MiB keeps that bounded; below 4 KiB the judge's own record no longer fits.", sizes=True))
    """Cap on each of stdout and stderr; the run is killed when one passes it (status "output_limit")."""
    python_executable: str | None = None
    """Interpreter for the program, started with -I (isolated: no user site, no PYTHON* variables) and -B.
    None: this process's interpreter (same packages) when the sandbox user can run it, else the system `python3`
    on PATH (standard library only; e.g. when Python is installed under root's private home)."""
    uid_base: int = _limit(2_100_000_000, Bounds(
        int, UID_SLOTS, 2**31 - 1 - UID_SLOTS, "Runs use uids uid_base .. uid_base + 65535: uid 0 is root (programs "
        "would read /etc/shadow), uids below 65536 belong to real and system accounts, and uids past 2**31 - 1 are "
        "refused by the kernel or read as negative by tools (every run would fail: scored None)."))
    """When started as root, run k of those in flight at once runs as uid = gid = uid_base + k; pick a range no
    real account uses."""
    max_workers: int = _limit(4, Bounds(int, 1, 64, "Runs in flight at once; each holds its pipes and output."))
    """Runs in flight at once in `Sandbox.run_many`."""
    max_host_stall_seconds: float | None = _limit(None, Bounds(
        float, 0, 3600, "Time the host may take from one run before it is given up as unknown.", none_ok=True))
    """How much wall time the host may take from a run (its processes stopped from outside, or waiting runnable
    for a CPU that none of the run's own processes was using) before the run is given up as "infra_error"
    (scored None). Time taken is added to the deadline, so a stall shorter than this costs no verdict.
    None: 2 x `timeout_seconds`, so that a program that only spins still reaches its CPU limit (a failure) on
    a host that gives it a quarter of a CPU or more. Needs `sandbox_protections()["host_stall_detection"]`."""

    def __post_init__(self) -> None:
        for spec in fields(self):
            bounds = spec.metadata.get("bounds")
            value = getattr(self, spec.name)
            if bounds is not None and not bounds.accepts(value):
                raise ValueError(
                    f"SandboxConfig.{spec.name}={value!r} is refused: it must be {bounds.describe()}. {bounds.why} "
                    f"Pass a value in that range (the default is {spec.default!r})."
                )
        if self.python_executable is not None and not (isinstance(self.python_executable, str)
                                                       and self.python_executable):
            raise ValueError(f"SandboxConfig.python_executable={self.python_executable!r} is refused: it must be "
                             "None or the path of a Python interpreter.")

    @property
    def host_stall_limit(self) -> float:
        return 2 * self.timeout_seconds if self.max_host_stall_seconds is None else self.max_host_stall_seconds

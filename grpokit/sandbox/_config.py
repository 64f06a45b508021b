"""The limits of one sandboxed run (`SandboxConfig`) and their checks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SandboxConfig:
    """Limits for one sandboxed run. Every limit applies to each run separately."""

    timeout_seconds: float = 10.0
    """Wall-clock limit; the whole process tree is killed when it passes (status "timeout")."""
    cpu_seconds: int = 5
    """RLIMIT_CPU per process (soft); SIGXCPU at the soft limit, SIGKILL one second later."""
    memory_bytes: int = 512 * 1024**2
    """The run's memory budget. Where a cgroup is available (`sandbox_protections()["memory_budget"]`): one
    budget for all of the run's processes and all kinds of memory (anonymous, tmpfs/shm files, kernel buffers),
    past which the run is killed (status "killed", reason "memory"). Also RLIMIT_AS per process (a single
    process gets MemoryError first). Without a cgroup only the per-process limit holds: see docs/rewards.md for
    the bound. Python itself needs about 30 MB; numpy/torch imports much more."""
    file_size_bytes: int = 16 * 1024**2
    """RLIMIT_FSIZE: the largest file the program may write."""
    disk_bytes: int = 64 * 1024**2
    """Size of the private tmpfs working directory (only where a mount namespace is available)."""
    max_files: int = 1024
    """Inodes of that tmpfs: files + directories the program may create."""
    max_processes: int = 16
    """Processes + threads of the run: the cgroup's pids.max (plus one for the init) where there is a cgroup, and
    RLIMIT_NPROC for the run's own uid (not enforced for root). Without the uid drop (a non-root caller) the
    kernel counts every process of the caller's uid against RLIMIT_NPROC."""
    max_open_files: int = 256
    """RLIMIT_NOFILE."""
    max_output_bytes: int = 1024**2
    """Cap on each of stdout and stderr; the run is killed when one passes it (status "output_limit")."""
    python_executable: str | None = None
    """Interpreter for the program, started with -I (isolated: no user site, no PYTHON* variables) and -B.
    None: this process's interpreter (same packages) when the sandbox user can run it, else the system `python3`
    on PATH (standard library only; e.g. when Python is installed under root's private home)."""
    uid_base: int = 2_100_000_000
    """When started as root, run k of those in flight at once runs as uid = gid = uid_base + k; pick a range no
    real account uses."""
    max_workers: int = 4
    """Runs in flight at once in `Sandbox.run_many`."""
    max_host_stall_seconds: float | None = None
    """How much wall time the host may take from a run (its processes stopped from outside, or waiting runnable
    for a CPU that none of the run's own processes was using) before the run is given up as "infra_error"
    (scored None). Time taken is added to the deadline, so a stall shorter than this costs no verdict.
    None: 2 x `timeout_seconds`, so that a program that only spins still reaches its CPU limit (a failure) on
    a host that gives it a quarter of a CPU or more. Needs `sandbox_protections()["host_stall_detection"]`."""

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_bytes", "file_size_bytes", "disk_bytes", "max_files",
                     "max_processes", "max_open_files", "max_output_bytes", "max_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SandboxConfig.{name} must be a positive int, got {value!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"SandboxConfig.timeout_seconds must be > 0, got {self.timeout_seconds!r}")
        if self.max_host_stall_seconds is not None and not self.max_host_stall_seconds >= 0:
            raise ValueError(
                f"SandboxConfig.max_host_stall_seconds must be >= 0 or None, got {self.max_host_stall_seconds!r}"
            )

    @property
    def host_stall_limit(self) -> float:
        return 2 * self.timeout_seconds if self.max_host_stall_seconds is None else self.max_host_stall_seconds
        if not 0 < self.uid_base < 2**31 - 65536:
            raise ValueError(f"SandboxConfig.uid_base must be in (0, 2**31 - 65536), got {self.uid_base!r}")

"""How a sandboxed run ended: its `Status` and the `SandboxResult` that `run_python` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "error", "timeout", "killed", "output_limit", "infra_error"]


@dataclass(frozen=True)
class SandboxResult:
    """How one run ended. `returncode` is the exit code, or -signal when killed by a signal; None when unknown."""

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_seconds: float
    reason: str = ""
    """Why the sandbox ended the run, when it did: "timeout", "cpu" (SIGXCPU/SIGKILL at RLIMIT_CPU, or the run's
    processes together past the CPU budget), "memory" (the run passed its memory budget), "output", "host_stall",
    "setup", "program_size" (status "error": the program does not fit the run's disk); "" otherwise."""
    host_stall_seconds: float = 0.0
    """Wall time the host took from the run (see SandboxConfig.max_host_stall_seconds); 0 where not measured."""
    peak_memory_bytes: int | None = None
    """The run's peak memory, all processes together (cgroup only; None without one)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

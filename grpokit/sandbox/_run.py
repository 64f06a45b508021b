"""The public entry points: `run_python` (one program) and `Sandbox` (a bounded pool of runs)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from grpokit.sandbox._config import SandboxConfig
from grpokit.sandbox._detection import _detect
from grpokit.sandbox._launcher import _launch
from grpokit.sandbox._result import SandboxResult


def run_python(code: str, stdin: str = "", config: SandboxConfig | None = None) -> SandboxResult:
    """Run `code` as a Python program in the sandbox, feed it `stdin`, and say how it ended.

    Never raises for anything the program does; a sandbox that cannot start gives status "infra_error".
    """
    config = config or SandboxConfig()
    try:
        setup = _detect(config.python_executable)
    except Exception as exc:  # noqa: BLE001 - the machine, not the program: scored None (unknown), never raised
        return SandboxResult("infra_error", None, "", f"sandbox setup failed: {type(exc).__name__}: {exc}", 0.0)
    if setup.mode is None:
        return SandboxResult("infra_error", None, "", "no sandbox launch mode works on this machine", 0.0)
    try:
        return _launch(code, stdin, config, setup.mode, setup.python)
    except OSError as exc:  # e.g. no space for the workdir, out of file descriptors
        return SandboxResult("infra_error", None, "", f"sandbox failed: {type(exc).__name__}: {exc}", 0.0)


class Sandbox:
    """A bounded pool of sandboxed runs: at most `config.max_workers` programs in flight at once."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()

    def run(self, code: str, stdin: str = "") -> SandboxResult:
        return run_python(code, stdin, self.config)

    def run_many(self, codes: Sequence[str], stdins: Sequence[str] | None = None) -> list[SandboxResult]:
        """Run every program (with the matching stdin) and return the results in input order."""
        stdins = list(stdins) if stdins is not None else [""] * len(codes)
        if len(stdins) != len(codes):
            raise ValueError(f"run_many got {len(codes)} programs but {len(stdins)} stdin texts; pass one per program")
        if not codes:
            return []
        with ThreadPoolExecutor(max_workers=min(self.config.max_workers, len(codes))) as pool:
            return list(pool.map(self.run, codes, stdins))

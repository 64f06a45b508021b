"""Watching a started run: pump its pipes until it ends, passes its deadline or a limit, kill what is left,
and turn the init's status report into a `SandboxResult`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import TYPE_CHECKING

from grpokit.sandbox._cgroup import RunCgroup
from grpokit.sandbox._config import SandboxConfig
from grpokit.sandbox._output import _Pipes
from grpokit.sandbox._process_tree import _kill_tree
from grpokit.sandbox._result import SandboxResult, Status
from grpokit.sandbox._stall import _SCHEDSTAT, _StallMeter, tree_usage

if TYPE_CHECKING:
    from grpokit.sandbox._launcher import _LaunchMode

_REAP_SECONDS = 2.0  # how long to wait for the killed process tree to release its pipes
_SAMPLE_SECONDS = 0.05  # the run's processes are read from /proc at most this often
_CPU_GRACE = 0.25  # CPU seconds past `cpu_seconds` before the run is killed: the init's start-up, one sample


def _decode_status(report: bytes) -> tuple[str | None, int | None]:
    """Parse the init's status-pipe report into (infra error message or None, returncode or None)."""
    if not report.startswith(b"B"):
        return "the sandbox launcher exited before the init process started", None
    body = report[1:]
    if body.startswith(b"E"):
        message = re.sub(rb"X-?\d+$", b"", body[1:])  # the init's exit report follows the child's error
        return "sandbox setup failed: " + message.decode(errors="replace"), None
    if body.startswith(b"X"):
        wait_status = int(body[1:])
        return None, os.waitstatus_to_exitcode(wait_status)
    return None, None  # init killed before the program ended (timeout kill, or killed from inside)


def _read_report(fd: int) -> bytes:
    os.set_blocking(fd, False)
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _supervise(
    proc: subprocess.Popen,
    stdin: bytes,
    config: SandboxConfig,
    tree: tuple[_LaunchMode, int | None, str],
    status_r: int,
    start: float,
    cgroup: RunCgroup | None = None,
) -> SandboxResult:
    """Pump the pipes until the run ends, the deadline passes or a limit is hit; then kill what is left.

    tree = (mode, uid, python): what `_kill_tree` needs to reach every process of the run. The run is killed
    when its processes together pass the CPU budget, `cpu_seconds` (a process alone gets SIGXCPU there first,
    hence _CPU_GRACE). The deadline moves by the time the host takes from the run (`_StallMeter`, only with the
    seccomp filter)."""
    mode = tree[0]
    meter = _StallMeter(proc.pid, mode.namespaces) if mode.seccomp and _SCHEDSTAT else None
    stall_limit = config.host_stall_limit
    pipes = _Pipes(proc, stdin, config.max_output_bytes)
    verdict, reason, stolen = _watch(proc, pipes, config, start, meter, stall_limit, cgroup)
    _kill_tree(proc, *tree)  # anything left; a no-op when the run ended cleanly inside a pid namespace
    proc.wait()
    if cgroup is not None and verdict is None and cgroup.oom_kills():
        verdict, reason = "killed", "memory"  # a child killed at the budget just before the program exited
    # After the kill, let the dying tree release the pipes, so no process of this run outlives the call.
    reap_deadline = time.monotonic() + _REAP_SECONDS
    while pipes.reading and time.monotonic() < reap_deadline:
        if not pipes.pump(0.05):
            break
    stdout, stderr = pipes.close()
    wall = time.monotonic() - start
    peak = cgroup.peak_bytes() if cgroup is not None else None
    extra = {"host_stall_seconds": round(stolen, 3), "peak_memory_bytes": peak}
    infra, returncode = _decode_status(_read_report(status_r))
    return _result(verdict, reason, infra, returncode, stdout, stderr, wall, stolen, stall_limit, extra)


def _watch(
    proc: subprocess.Popen,
    pipes: _Pipes,
    config: SandboxConfig,
    start: float,
    meter: _StallMeter | None,
    stall_limit: float,
    cgroup: RunCgroup | None,
) -> tuple[Status | None, str, float]:
    """`_supervise`'s loop: pump the pipes until the run ends (verdict None) or a limit stops it; returns the
    verdict, its reason and the seconds the host took from the run."""
    verdict: Status | None = None
    reason = ""
    exited_at = None
    stolen = 0.0
    sampled = -_SAMPLE_SECONDS
    while True:
        now = time.monotonic()
        if now - sampled >= _SAMPLE_SECONDS:
            sampled = now
            usage = tree_usage(proc.pid)
            if usage.cpu > config.cpu_seconds + _CPU_GRACE:
                verdict, reason = "killed", "cpu"
                break
            stolen = meter.sample(now, usage) if meter is not None else 0.0
            if stolen > stall_limit:
                verdict, reason = "infra_error", "host_stall"
                break
        if cgroup is not None and cgroup.oom_kills():
            verdict, reason = "killed", "memory"
            break
        deadline = start + config.timeout_seconds + stolen
        if now >= deadline:
            verdict, reason = "timeout", "timeout"
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if not pipes.reading:
            # Output closed: wait (to the deadline) for the init to report the exit status; the program may
            # also have closed its stdout and kept running.
            if exited_at is not None:
                break
            try:
                proc.wait(timeout=min(0.05, max(deadline - now, 0.0)))
            except subprocess.TimeoutExpired:
                pass
            continue
        if exited_at is not None and now - exited_at > 0.5:
            break  # the init is gone but something (an escaped daemon) holds the pipes: stop listening
        if not pipes.pump(min(deadline - now, 0.1)):
            verdict, reason = "output_limit", "output"
            break
    return verdict, reason, stolen


def _result(
    verdict: Status | None,
    reason: str,
    infra: str | None,
    returncode: int | None,
    stdout: str,
    stderr: str,
    wall: float,
    stolen: float,
    stall_limit: float,
    extra: dict,
) -> SandboxResult:
    """The `SandboxResult` of a finished run: `_watch`'s verdict first, then a setup failure the init reported,
    then the program's own exit."""
    if verdict == "infra_error":
        message = (f"the host stalled the run: it took {stolen:.1f} s of the run's {wall:.1f} s (stopped from "
                   f"outside, or waiting for a CPU), more than max_host_stall_seconds={stall_limit:g}")
        return SandboxResult("infra_error", None, stdout, f"{message}\n{stderr}".strip(), wall, reason, **extra)
    if infra is not None and verdict is None:
        return SandboxResult("infra_error", None, stdout, f"{infra}\n{stderr}".strip(), wall, "setup", **extra)
    if verdict is not None:
        return SandboxResult(verdict, returncode, stdout, stderr, wall, reason, **extra)
    if returncode is None:
        return SandboxResult("killed", None, stdout, stderr, wall, **extra)
    reason = "cpu" if returncode == -signal.SIGXCPU else ""
    status: Status = "ok" if returncode == 0 else ("killed" if returncode < 0 else "error")
    return SandboxResult(status, returncode, stdout, stderr, wall, reason, **extra)

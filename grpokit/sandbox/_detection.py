"""Finding, once per interpreter choice, the strongest launch mode that works on this machine, and which
protections it gives (`sandbox_protections`); logged once on logger "grpokit.sandbox"."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
from dataclasses import dataclass

from grpokit.sandbox import _cgroup
from grpokit.sandbox._config import SandboxConfig
from grpokit.sandbox._launcher import MINIMAL_PATH, _launch, _LaunchMode
from grpokit.sandbox._stall import _SCHEDSTAT

logger = logging.getLogger("grpokit.sandbox")


@dataclass(frozen=True)
class _Setup:
    """What detection found: the launch mode and interpreter to use (None: nothing works) and their protections."""

    mode: _LaunchMode | None
    python: str | None
    protections: dict[str, bool]


_DETECT_LOCK = threading.Lock()
_DETECTED: dict[str | None, _Setup] = {}

_PROBE = """
import errno, json, os, socket
try:
    s = socket.socket()
    sockets = "allowed"
except PermissionError:
    sockets = "refused"
    net = "isolated"
else:
    try:
        s.connect(("127.0.0.1", 9))
        net = "open"
    except OSError as exc:
        net = "isolated" if exc.errno == errno.ENETUNREACH else "open"
cgroups = open("/proc/self/cgroup").read()
print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "net": net, "sockets": sockets,
                  "cgroup": "/grpokit-" in cgroups, "ro": bool(os.statvfs("/").f_flag & os.ST_RDONLY)}))
"""


def _candidate_modes() -> list[_LaunchMode]:
    """Launch modes from strongest to weakest that make sense for this process; each base mode first with the
    seccomp filter and a cgroup (where one can be made), then without what failed."""
    root = os.geteuid() == 0
    bases = []
    if shutil.which("unshare", path=MINIMAL_PATH) is not None:
        bases += [(True, not root, root, True), (True, not root, root, False)]
        if root:
            bases.append((True, False, False, True))
    if root:
        bases.append((False, False, True, False))
    bases.append((False, False, False, False))
    cgroup = _cgroup.parents() is not None
    extras = list(dict.fromkeys([(True, cgroup), (True, False), (False, cgroup), (False, False)]))
    return [_LaunchMode(*base, seccomp=sc, cgroup=cg) for base in bases for sc, cg in extras]


def _candidate_interpreters(requested: str | None) -> list[str]:
    """The requested interpreter only; by default this process's, then the system python3 as a fallback."""
    if requested is not None:
        return [requested]
    system = shutil.which("python3", path=MINIMAL_PATH)
    return list(dict.fromkeys([sys.executable] + ([system] if system else [])))


def _probe(mode: _LaunchMode, python: str) -> dict | None:
    """Run a tiny program under `mode` and report what it could see, or None when the mode does not work."""
    result = _launch(_PROBE, "", SandboxConfig(timeout_seconds=20.0), mode, python)
    if not result.ok:
        logger.debug("sandbox mode %s with %s unavailable: %s %s", mode, python, result.status, result.stderr[-500:])
        return None
    try:
        return json.loads(result.stdout)
    except ValueError:
        return None


def _protections(mode: _LaunchMode | None, probe: dict) -> dict[str, bool]:
    started = mode is not None
    unprivileged = started and (os.geteuid() != 0 or (mode.drop_privileges and probe.get("uid", 0) != 0))
    return {
        "resource_limits": started,
        "wall_clock_kill": started,
        "output_cap": started,
        "clean_environment": started,
        "no_new_privileges": started,
        "unprivileged_user": unprivileged,
        "process_limit": unprivileged or bool(probe.get("cgroup")),
        "network_isolation": probe.get("net") == "isolated",
        "pid_namespace": probe.get("pid") == 2,  # our init is pid 1, the program its first child
        "read_only_filesystem": bool(probe.get("ro")),
        "private_workdir": started and mode.read_only_filesystem,
        "seccomp_filter": probe.get("sockets") == "refused",
        "memory_budget": bool(probe.get("cgroup")),
        "host_stall_detection": probe.get("sockets") == "refused" and _SCHEDSTAT,
    }


def _detect(requested: str | None) -> _Setup:
    """Find (once per requested interpreter) the strongest launch mode that works here; log what it protects."""
    with _DETECT_LOCK:
        if requested in _DETECTED:
            return _DETECTED[requested]
        setup = _Setup(None, None, _protections(None, {}))
        interpreters = _candidate_interpreters(requested)
        for mode in _candidate_modes():
            for python in interpreters:
                found = _probe(mode, python)
                if found is not None:
                    setup = _Setup(mode, python, _protections(mode, found))
                    break
            if setup.mode is not None:
                break
        _DETECTED[requested] = setup
        _log_setup(setup, interpreters)
        return setup


def _log_setup(setup: _Setup, interpreters: list[str]) -> None:
    if setup.mode is None:
        logger.error(
            "the sandbox cannot start programs with %s: every code run will be scored None (unknown). Check that "
            "the interpreter runs, or set SandboxConfig(python_executable=...)", " or ".join(interpreters),
        )
        return
    active = [name for name, on in setup.protections.items() if on]
    missing = [name for name, on in setup.protections.items() if not on]
    logger.info("sandbox runs programs with %s; protections active: %s", setup.python, ", ".join(active))
    if setup.python != interpreters[0]:
        logger.warning(
            "the sandbox user cannot run %s (is it under a private home such as /root?); sandboxed programs use %s "
            "and see only its packages. Set SandboxConfig(python_executable=...) to choose.", interpreters[0],
            setup.python,
        )
    if missing:
        logger.warning(
            "sandbox protections missing: %s. The namespaces need util-linux `unshare` and either root or "
            "unprivileged user namespaces, and an interpreter that other users can run; seccomp_filter and "
            "host_stall_detection need seccomp (x86_64 or aarch64); memory_budget needs a cgroup this process may "
            "create (v2 with memory+pids delegated, or v1). docs/rewards.md says what each missing one allows.",
            ", ".join(missing),
        )


def sandbox_protections(python_executable: str | None = None) -> dict[str, bool]:
    """Which protections runs on this machine get (detected on first use, then cached per interpreter choice)."""
    return dict(_detect(python_executable).protections)

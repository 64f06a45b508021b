"""Reaching and killing every process a run started (through the init behind `unshare`, or by uid)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpokit.sandbox._launcher import _LaunchMode

logger = logging.getLogger("grpokit.sandbox")


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc), used to reach the init behind `unshare`."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as fh:
            return [int(p) for p in fh.read().split()]
    except OSError:
        return []


def _kill_uid(uid: int, python: str) -> None:
    """SIGKILL every process of `uid` by running kill(-1) as that uid (it may signal only its own processes)."""
    try:
        subprocess.run(
            [python, "-I", "-S", "-c", "import os; os.kill(-1, 9)"],
            user=uid, group=uid, extra_groups=[], env={}, timeout=10,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("could not sweep leftover processes of sandbox uid %d: %s", uid, exc)


def _kill_tree(proc: subprocess.Popen, mode: _LaunchMode, uid: int | None, python: str) -> None:
    """Kill everything the run started.

    With a pid namespace, killing its init (the child of `unshare`) makes the kernel kill the whole namespace.
    Without one, a daemon that called setsid() has left the process group; a uid sweep still reaches it.
    """
    for pid in _children(proc.pid) if mode.namespaces else []:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if uid is not None and not mode.namespaces:
        _kill_uid(uid, python)

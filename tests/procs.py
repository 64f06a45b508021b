"""Running a command whose whole process tree can be killed, with a timeout on every wait.

torchrun (under `accelerate launch`) starts each worker in a session of its own, so killing the launcher's
process group misses the workers. `run_tree` starts the command in a new session, and on a timeout kills every
descendant it can find (psutil walks the tree while it is still whole) and the session itself, then reads the
pipes with a timeout too.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, every descendant, and the process groups they lead; processes already gone are skipped."""
    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    groups = {pid}
    for process in family:
        try:
            groups.add(os.getpgid(process.pid))
        except ProcessLookupError:
            pass
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


class TreeTimeout(AssertionError):
    """The command outlived its timeout; its tree was killed. Carries what it wrote."""

    def __init__(self, command, timeout: float, stdout: str, stderr: str) -> None:
        super().__init__(f"{command} did not finish within {timeout} s; killed its whole process tree.\n"
                         f"stderr tail:\n{stderr[-3000:]}")
        self.stdout, self.stderr = stdout, stderr


def run_tree(command: list[str], timeout: float, **popen) -> subprocess.CompletedProcess:
    """subprocess.run with text pipes, where a timeout kills the command's whole process tree (TreeTimeout)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **popen)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a pipe held open by something outside the tree
            stdout, stderr = "", ""
        raise TreeTimeout(command, timeout, stdout or "", stderr or "") from None
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def wait_for(predicate, process: subprocess.Popen, timeout: float = 120.0, what: str = "the run") -> None:
    """Poll `predicate` until it holds; fail when `process` ends first (with its stderr's tail, when it was piped)
    or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if process.poll() is not None:
            stderr = process.communicate(timeout=30)[1] if process.stderr is not None else ""
            raise AssertionError(f"{what} ended early (exit {process.returncode})\n{(stderr or '')[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def kill_after_checkpoint(command: list[str], out, env: dict, delay: tuple[float, float] = (0.0, 1.5),
                          timeout: float = 120.0) -> tuple[float, bool]:
    """Start a training `command` in a session of its own, wait for OUT/checkpoint-1, wait a random time within
    `delay`, then SIGKILL its whole tree: (the time waited, whether the run was still going when killed)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        wait_for(lambda: (Path(out) / "checkpoint-1" / "trainer_state.json").is_file(), process, timeout,
                 "checkpoint-1")
        pause = random.uniform(*delay)
        time.sleep(pause)
        alive = process.poll() is None
    finally:
        kill_tree(process.pid)
        process.communicate(timeout=30)
    return pause, alive

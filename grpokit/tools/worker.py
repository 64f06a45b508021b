"""The process that runs a toolbox's standalone tools, so that no call outlives its timeout.

    worker = ToolWorker(functions, call_tool)   # nothing starts yet
    worker.call("search", {"q": "x"}, 10.0)     # {"text": ...} or {"error": ...}; never raises
    worker.close()                              # also when the worker is garbage-collected, and at exit

The worker is forked from the trainer at its first call, so it holds every tool as the trainer does (closures
and globals included; nothing is pickled but the arguments) and costs one fork, not one per call. Calls go to it
one at a time through a pipe, results come back as JSON through another. The trainer kills it, with every process
it started, when a call does not answer within its timeout (a hang, a spin), and replaces it (forked again at the
next call) when it died, grew by more than MAX_WORKER_GROWTH bytes (a leak), or a call left a thread running in
it; after every call the worker itself kills the processes the tool started. The worker runs in a session of its
own (Ctrl-C in the terminal reaches the trainer, not the tool) and dies with the trainer (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Callable

MAX_REPLY_BYTES = 1 << 20  # one reply: a result cut to the toolbox's 50,000 characters, as JSON, fits
MAX_WORKER_GROWTH = 1 << 30  # a worker whose resident memory grew more than this since its fork is replaced
POLL_SECONDS = 0.1  # how often a wait looks whether the worker ended while a process it left holds its pipe
_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER = 1, 36  # prctl options (linux/prctl.h)
_HEADER = 8  # bytes of a message's length, before the message
_LIBC = ctypes.CDLL(None, use_errno=True)


class ToolWorker:
    """Runs `functions` (name -> callable) in a forked process; `call_tool(func, arguments)` makes the reply dict
    inside the worker. Thread-safe: one call at a time."""

    def __init__(self, functions: dict[str, Callable], call_tool: Callable[..., dict[str, str]]) -> None:
        self.functions, self.call_tool = functions, call_tool
        self.pid: int | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def call(self, name: str, arguments: dict[str, Any], timeout: float) -> dict[str, str]:
        """Run functions[name](**arguments) in the worker: {"text": ...}, or {"error": ...} when it raised, did not
        answer within `timeout` seconds, or its process ended without answering."""
        with self._lock:
            request = pickle.dumps((name, arguments))
            if not self._send(request):  # it died between calls (killed from outside): a fresh one
                self.close()
                self._send(request)
            reply = _read_message(self._replies, self.pid, time.monotonic() + timeout)
            if reply is None:
                self.close()
                return {"error": f"tool {name!r} did not return within {timeout:g} s"}
            outcome = _decode(reply)
            if outcome is None or outcome.get("end") or _resident(self.pid) - self._base > MAX_WORKER_GROWTH:
                status = self.close()
                if outcome is None:
                    return {"error": f"tool {name!r} ended its process without returning a result{_how(status)}"}
            return {key: outcome[key] for key in ("text", "error") if key in outcome}

    def close(self) -> int | None:
        """Kill the worker and what it started; its wait status (None when none ran or it was already gone)."""
        status = self._finalizer() if self._finalizer is not None else None
        self.pid = self._finalizer = None
        return status

    def _send(self, request: bytes) -> bool:
        if self.pid is None:
            self._start()
        try:
            _write_all(self._requests, len(request).to_bytes(_HEADER, "little") + request)
            return True
        except OSError:  # EPIPE: it is gone
            return False

    def _start(self) -> None:
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        _flush_stdio()  # else the worker inherits the trainer's unwritten output and prints it again
        with warnings.catch_warnings():  # Python 3.12 warns on every fork of a process with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.close(requests_write)
            os.close(replies_read)
            _serve(self.functions, self.call_tool, requests_read, replies_write)  # never returns
        os.close(requests_read)
        os.close(replies_write)
        # The worker's own resident size at its fork, not the trainer's: a fork does not copy the page tables of
        # file-backed mappings (libraries, mmapped weights), so the child starts smaller than its parent, by
        # hundreds of MB in a large process, and a growth measured from the parent's size would never be seen.
        self._base = _resident(pid)
        self.pid, self._requests, self._replies = pid, requests_write, replies_read
        self._finalizer = weakref.finalize(self, _stop, pid, (requests_write, replies_read))


def _stop(pid: int, fds: tuple[int, ...]) -> int | None:
    """The finalizer: close the pipes, kill the worker and its descendants, reap it."""
    for fd in fds:
        os.close(fd)
    return _end(pid)


# ---------------------------------------------------------------- inside the worker
def _serve(functions: dict[str, Callable], call_tool: Callable, requests: int, replies: int) -> None:
    """The worker's life: requests in, replies out, until the trainer closes the pipe or a call leaves a thread
    running; it never returns into the trainer's code. A process a tool forked that returns here exits."""
    me = os.getpid()
    try:
        os.setsid()  # its own session and process group: the terminal's Ctrl-C is the trainer's alone
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of its descendants stay findable below it
        _LIBC.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)  # dies when the thread that forked it ends
        gc.freeze()  # the trainer's objects: never scanned, so never copied on write by the collector
        os._exit = _exiting_cleanly(me, os._exit)  # a tool's os._exit kills what it started first
        while (request := _read_exact(requests)) is not None:
            name, arguments = pickle.loads(request)
            outcome = call_tool(functions[name], arguments)
            if os.getpid() != me:
                break
            _flush_stdio()
            _kill_descendants(me)
            outcome["end"] = len(os.listdir("/proc/self/task")) > 1  # a thread the call left behind
            reply = json.dumps(outcome).encode()
            _write_all(replies, len(reply).to_bytes(_HEADER, "little") + reply)
            if outcome["end"]:
                break
    finally:
        try:
            if os.getpid() == me:
                _kill_descendants(me)
        finally:
            os._exit(0)


def _exiting_cleanly(me: int, exit_now: Callable[[int], Any]) -> Callable[[int], Any]:
    """os._exit for the worker: its descendants are killed first (once it is gone, those that left its process
    group would be re-parented out of reach); a process a tool forked exits as it asked."""

    def _exit(status: int) -> Any:
        if os.getpid() == me:
            _kill_descendants(me)
        return exit_now(status)

    return _exit


def _read_exact(fd: int) -> bytes | None:
    """One message, blocking; None when the pipe is closed."""
    data = bytearray()
    size = _HEADER
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
        if size == _HEADER and len(data) == _HEADER:
            size += int.from_bytes(data, "little")
    return bytes(data[_HEADER:])


# ---------------------------------------------------------------- in the trainer
def _read_message(fd: int, pid: int, deadline: float) -> bytes | None:
    """One message from the worker; b"" when it ended (or wrote something that is not one message), None when
    the deadline passed first."""
    data, size = bytearray(), None
    poll = select.poll()  # not select.select: it refuses descriptors past 1023, which a big trainer may hold
    poll.register(fd, select.POLLIN)
    while size is None or len(data) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        if poll.poll(min(left, POLL_SECONDS) * 1000):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            data += chunk
            if size is None and len(data) >= _HEADER:
                size = _HEADER + int.from_bytes(data[:_HEADER], "little")
                if size > MAX_REPLY_BYTES:
                    return b""
        elif os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return b""  # it ended, and a process it left holds the pipe open
    return bytes(data[_HEADER:]) if len(data) == size else b""


def _decode(reply: bytes) -> dict[str, Any] | None:
    """The reply as {"text" or "error": str, "end": bool}, or None when it is not one."""
    try:
        outcome = json.loads(reply)
    except ValueError:
        return None
    if not isinstance(outcome, dict) or not any(isinstance(outcome.get(k), str) for k in ("text", "error")):
        return None
    return outcome


def _end(pid: int) -> int | None:
    """Stop the worker and its process group, kill every descendant (those that left the group too), then the
    worker; its wait status (None if it could not be had)."""
    _signal(pid, signal.SIGSTOP)
    _kill_descendants(pid)
    _signal(pid, signal.SIGKILL)
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:  # SIGCHLD ignored elsewhere: the kernel reaped it
        return None


def _signal(pid: int, signum: int) -> None:
    """The worker and its process group (whose id is the worker's pid once it called setsid)."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signum)
        except OSError:  # already ended, or no group (yet, or any more)
            pass


def _kill_descendants(pid: int) -> None:
    """SIGKILL every descendant of `pid`, again while new ones appear (one may fork while the others are killed).
    In the worker itself (`pid` is this process) they are reaped too: a subreaper's orphans would stay zombies."""
    own, killed = pid == os.getpid(), set()
    for _ in range(100):
        found = set(_descendants(pid)) - killed
        if not found:
            return
        for child in found:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass
        if own:
            _reap_children(pid)
        else:  # the dead stay listed (zombies) until the worker, their adopter, is reaped
            killed |= found


def _reap_children(pid: int) -> None:
    """Wait for this process's children (all were just killed); their own orphans become its children next."""
    for child in _descendants(pid, depth=1):
        try:
            os.waitpid(child, 0)
        except ChildProcessError:
            pass


def _descendants(pid: int, depth: int | None = None) -> list[int]:
    """The processes below `pid` (its children only with depth=1), from /proc/<pid>/task/<tid>/children (the
    children of each of its threads)."""
    found, queue = [], [(pid, 0)]
    while queue:
        parent, level = queue.pop()
        if level == depth:
            continue
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children", encoding="ascii") as fh:
                    children = [int(p) for p in fh.read().split()]
            except OSError:
                continue
            found += children
            queue += [(child, level + 1) for child in children]
    return found


def _resident(pid: int) -> int:
    """Resident memory of `pid` in bytes (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _how(status: int | None) -> str:
    """How a worker ended, from its wait status: ' (exit status 3)', ' (killed by SIGSEGV)', or ''."""
    if status is not None and os.WIFSIGNALED(status):
        return f" (killed by {signal.Signals(os.WTERMSIG(status)).name})"
    if status is not None and os.WIFEXITED(status):
        return f" (exit status {os.WEXITSTATUS(status)})"
    return ""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _flush_stdio() -> None:
    """Flush sys.stdout and sys.stderr (os._exit and fork flush nothing); a stream a tool closed is skipped."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001 - closed, None, or a replacement that raises
            pass

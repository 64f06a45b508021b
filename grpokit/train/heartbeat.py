"""The asynchronous producer's heartbeat: how long the producer thread has shown no progress (asynchronous.py).

    watch = Heartbeat(limit)                # heartbeat_stale_after_s
    watch.pulse("generating ...", engine)    # the producer (its collector): around engine and reward calls
    watch.idle_seconds(thread)               # the learner, while it waits for the producer
    raise watch.stalled(idle)                # GenerationStalled, naming what the producer was doing

Progress is any of: a pulse (an engine, reward or tool call starting or finishing); the producer thread's
innermost Python frame moving or its CPU time growing (a long reward or tool computing, a local engine decoding);
while it waits on an engine that can be asked (a vLLM server: /health, the engine's `responsive()`), that engine
answering, asked only once the rest has been still for the limit. So a long generation on a live server or a long
computation is not a stall, and a call blocked on a hung server, a lock or a socket is.

The producer writes `beat` (one tuple, assigned at once) without a lock; the learner reads it. Everything else
here is the learner's.
"""

from __future__ import annotations

import math
import sys
import threading
import time


class GenerationStalled(RuntimeError):
    """The producer made no progress for heartbeat_stale_after_s seconds (a hung server, tool or reward)."""


class Heartbeat:
    """The producer's last pulse, and how long it has shown no progress as the learner sees it (module docstring).

    limit: heartbeat_stale_after_s. beat: (when, what the producer does, the engine it waits on or None)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.beat: tuple[float, str, object] = (time.perf_counter(), "starting", None)
        self.reset()

    def pulse(self, doing: str, engine=None) -> None:
        """Progress (the producer thread): the collector calls it around engine and reward calls, with the engine
        while it waits on one."""
        self.beat = (time.perf_counter(), doing, engine)

    @property
    def doing(self) -> str:
        return self.beat[1]

    def reset(self) -> None:
        """Forget where the thread was seen (the producer is not working: its stillness is no stall)."""
        self.mark: tuple | None = None
        self.moved = -math.inf

    def idle_seconds(self, thread: threading.Thread | None) -> float:
        """Seconds since the latest of the last pulse, the last time the learner saw `thread` move (frame_mark),
        and the last time the engine of the last pulse answered `responsive()`."""
        since, _, engine = self.beat
        now = time.perf_counter()
        mark = frame_mark(thread)
        if mark != self.mark:
            self.mark, self.moved = mark, now
        idle = now - max(since, self.moved)
        probe = getattr(engine, "responsive", None)
        if idle > self.limit and probe is not None and probe():
            self.moved = time.perf_counter()  # a server still working on a long call
            return 0.0
        return idle

    def stalled(self, idle: float) -> GenerationStalled:
        """The error that stops the run after `idle` seconds without progress."""
        return GenerationStalled(
            f"Asynchronous rollouts: the producer made no progress for {idle:.0f} s "
            f"(heartbeat_stale_after_s={self.limit:g}); it was {self.doing}. A hung inference server, tool or "
            "reward function stops the run here; its checkpoints in output_dir are intact (on one process the "
            "last finished step is saved now): fix the cause and resume (--resume / "
            "train(resume_from_checkpoint=True)).")


def frame_mark(thread: threading.Thread | None) -> tuple | None:
    """Where `thread` is and how much CPU it has used: (its innermost Python frame, code and instruction, its CPU
    seconds to the hundredth where the system tells them). The same between two looks only if the thread neither
    ran Python code elsewhere nor computed (a thread blocked on a socket, a lock or a sleep)."""
    if thread is None or thread.ident is None:
        return None
    frame = sys._current_frames().get(thread.ident)
    where = None if frame is None else (id(frame), frame.f_code, frame.f_lasti)
    try:  # a tight loop is always seen at the same instruction (where it yields the GIL): its CPU time moves
        cpu = round(time.clock_gettime(time.pthread_getcpuclockid(thread.ident)), 2)
    except (AttributeError, OSError):  # no per-thread CPU clock here (macOS, Windows): the frame alone
        cpu = None
    return where, cpu

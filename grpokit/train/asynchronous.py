"""Asynchronous rollouts: a producer thread generates the next batches while the learner trains on this one.

    pipeline = Ahead(collector, learner, ...)        # max_staleness = k > 0
    pipeline.start(state)                            # the thread starts; the weights of now are published
    batch = pipeline.next(state)                     # the next ScoredBatch, waiting if it is not ready
    pipeline.quiesce(); pipeline.publish(state)      # after each step: no batch half-made, then new weights

The schedule is fixed in advance, so a run is deterministic and a resume equals the uninterrupted run. Generation
batch b is first trained on after S(b) = floor(b * M / A) optimizer steps (M: micro-batches a batch serves,
steps_per_generation x num_iterations; A: gradient_accumulation_steps). Weights are published at sync points,
every weight_sync_steps = w steps; the version a step trains with is V = floor(S / w). Batch b is generated with
the weights of version max(0, V(b) - k), that is after step w x max(0, V(b) - k): never older than k versions
(k x w steps when w > 1) and never newer, so with k >= 1 it can be generated while earlier steps train. No sample
is ever generated and then found too old; `async/dropped` counts only batches a resume with a smaller
max_staleness (or another number of processes) could not use.

The producer thread owns a shadow copy of the policy (one more copy of the weights, documented in docs/async.md)
that it loads from the snapshot of its batch's version, between its own generations: a push never races a
generation still reading older weights, and the learner never waits for the producer to read its weights. The
engine is given the shadow's weights (vLLM) or generates from the shadow itself (the local engine). Published
snapshots are CPU copies, dropped once no batch needs them (at most k + 1 are held).

The learner waits for a batch with a heartbeat (`Heartbeat`): if, while it waits, the producer showed no progress
for heartbeat_stale_after_s, or failed, the learner raises its error and the run stops; the producer waits on
nothing without a timeout. Progress is an engine or reward call finishing, the producer thread's innermost Python
frame moving or its CPU time growing (a long reward or tool computing, a local engine decoding), or, while it waits
on an engine that can be asked (a vLLM server: /health), that engine answering. So a long generation on a live
server or a long computation never stops the run, and a call blocked on a hung server, a lock or a socket does.

Before an evaluation or a checkpoint the loop calls quiesce(): the producer finishes the batches the published
weights can make and stops, so evaluation has the engine to itself and a checkpoint holds every batch that older
weights made (rollouts_<rank>.pt), the data position after them, and nothing half-made. With several processes
each runs its own producer, and the producers' collectives (the rewards' gather, the push barrier) use their own
process group, never the learner's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from grpokit.data import SamplerState
from grpokit.train.batches import ScoredBatch, TrainerState

logger = logging.getLogger("grpokit")


class GenerationStalled(RuntimeError):
    """The producer made no progress for heartbeat_stale_after_s seconds (a hung server, tool or reward)."""


# ---------------------------------------------------------------------- the schedule (pure)
def first_step(batch: int, uses: int, per_step: int) -> int:
    """S(b): optimizer steps done when generation batch `batch` is first trained on (uses: M, per_step: A)."""
    return batch * uses // per_step


def weights_step(batch: int, uses: int, per_step: int, staleness: int, sync_every: int) -> int:
    """The optimizer step whose weights generate batch `batch`: w x max(0, floor(S(b) / w) - k)."""
    return sync_every * max(0, first_step(batch, uses, per_step) // sync_every - staleness)


def batches_before(steps: int, uses: int, per_step: int) -> int:
    """Generation batches first trained on before step `steps` (those a run `steps` steps in has taken)."""
    return math.ceil(steps * per_step / uses)


def overlap_seconds(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two lists of disjoint (start, end) intervals, each sorted."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------- the producer's copy of the policy
class ShadowPolicy:
    """The producer's policy for the collector: `version`, `weights()` (the shadow model) and `generating()`."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self.model, self.version = model, version

    def weights(self) -> torch.nn.Module:
        return self.model

    def generating(self):
        return contextlib.nullcontext()

    def load(self, snapshot: "Snapshot") -> None:
        if snapshot.version != self.version:
            self.model.load_state_dict(snapshot.tensors, strict=False)
            self.version = snapshot.version


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """The policy's changing tensors at a sync point, on the CPU: `step` (optimizer steps done), the learner's
    `version`, and the tensors by state-dict name (a PEFT model: the trainable ones only)."""

    step: int
    version: int
    tensors: dict[str, torch.Tensor]


def shadow_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the unwrapped policy in eval mode, for generation only."""
    shadow = copy.deepcopy(model)
    shadow.requires_grad_(False)
    return shadow.eval()


def take_snapshot(model: torch.nn.Module, step: int, version: int) -> Snapshot:
    """The tensors an optimizer step can change, copied to the CPU (all of them unless some are frozen)."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = any(not p.requires_grad for p in model.parameters())
    tensors = {name: t.detach().to("cpu", copy=True) for name, t in model.state_dict().items()
               if not frozen or name in trainable}
    return Snapshot(step, version, tensors)


# ---------------------------------------------------------------------- the heartbeat
class Heartbeat:
    """How long the producer has shown no progress, as seen by the learner while it waits (module docstring).

    idle_seconds(since, thread, engine): seconds since the latest of `since` (the producer's last pulse), the last
    time the learner saw the thread move (frame_mark), and the last time `engine` (the one the producer waits on,
    or None) answered `responsive()`; that engine is asked only once the rest has been still for `limit`."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.reset()

    def reset(self) -> None:
        self.mark: tuple | None = None
        self.moved = -math.inf

    def idle_seconds(self, since: float, thread: threading.Thread | None, engine) -> float:
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


# ---------------------------------------------------------------------- the pipeline
@dataclasses.dataclass
class Made:
    """A batch the producer made: its index, the step whose weights made it, the batch, and the rounds generated
    and epochs of prompts used up to it (what the learner's counters read when it takes the batch)."""

    index: int
    step: int
    batch: ScoredBatch
    generations: int
    epoch: float


class Ahead:
    """Generate up to max_staleness versions ahead of the learner (see the module docstring).

    collector: the producer's Collector (its own Comm on a generation process group, a ShadowPolicy, its engine);
    learner: read at sync points only (take_snapshot); uses / per_step: M and A of the schedule; total: the
    micro-batches the run trains on (None: unbounded); options: GRPOConfig (max_staleness, weight_sync_steps,
    queue_maxsize, heartbeat_stale_after_s)."""

    def __init__(self, collector, learner, uses: int, per_step: int, args) -> None:
        self.collector, self.learner, self.uses, self.per_step = collector, learner, uses, per_step
        self.staleness, self.sync_every = args.max_staleness, args.weight_sync_steps
        self.queue_limit = args.queue_maxsize
        self.policy: ShadowPolicy = collector.policy
        collector.pulse = self.pulse
        self.cond = threading.Condition()
        self.made: deque[Made] = deque()  # finished, not yet taken by the learner
        self.snapshots: dict[int, Snapshot] = {}
        self.next_index = 0  # the next batch the producer makes
        self.last_index: int | None = None  # the last batch the run needs (None: unbounded)
        self.floor = 0  # no batch is made with weights older than this step's (those of the run's start)
        self.generations: int | None = None  # rounds generated (offsets sample ids), after the last made batch
        self.consumed_epoch: float | None = None
        self.error: BaseException | None = None
        self.status = "stopped"  # working / waiting (for weights or room) / done / failed / stopped
        self.draining = False
        self.stalled = False  # the heartbeat gave up on the producer (it may still be inside a call)
        self.beat = (time.perf_counter(), "starting", None)  # (when, what the producer does, engine it waits on)
        self.watch = Heartbeat(args.heartbeat_stale_after_s)
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.dropped = 0
        self.busy: list[tuple[float, float]] = []  # the producer's working intervals (monotonic clock)
        self.waited_for_weights = 0.0
        self.metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ the learner's side
    def start(self, state: TrainerState, total_micro_batches: int | None) -> None:
        """Start the producer thread at `state` (a fresh run or a resume) and publish the weights of now."""
        self.last_index = None if total_micro_batches is None else math.ceil(total_micro_batches / self.uses) - 1
        taken = batches_before(state.global_step, self.uses, self.per_step)
        with self.cond:
            self.keep_usable(state.global_step)
            self.next_index = taken + len(self.made)
            if self.generations is None:  # a fresh run, or a checkpoint of the synchronous loop
                self.generations = state.generations
            if self.consumed_epoch is None:
                self.consumed_epoch = state.epoch
            # batches the checkpoint did not hold (another number of processes, the synchronous loop's checkpoint)
            # are made with the weights of now: the older ones are gone
            self.floor = state.global_step
        self.publish(state, always=True)
        self.stop_event = threading.Event()  # its own: a thread left inside a call by close() never resumes work
        self.error, self.status, self.stalled = None, "waiting", False
        self.thread = threading.Thread(target=self.produce, args=(self.stop_event,), name="grpokit-rollouts",
                                       daemon=True)
        self.thread.start()

    def keep_usable(self, step: int) -> None:
        """Drop made batches a run at `step` may not train on: made by weights older than the staleness bound."""
        for made in list(self.made):
            index_step = first_step(made.index, self.uses, self.per_step)
            if index_step // self.sync_every - made.step // self.sync_every > self.staleness or index_step < step:
                self.made.remove(made)
                self.dropped += 1
                logger.warning("Asynchronous rollouts: generation batch %d (made by the weights of step %d) is "
                               "older than max_staleness=%d allows here; dropped.", made.index, made.step,
                               self.staleness)

    def publish(self, state: TrainerState, always: bool = False) -> None:
        """At a sync point (global_step a multiple of weight_sync_steps): the weights of now, for the batches that
        need them. Called after the step's evaluation and checkpoint (`always`: at the start of train())."""
        step = state.global_step
        if step % self.sync_every and not always:
            return
        snapshot = take_snapshot(self.learner.unwrapped, step, self.learner.version)
        with self.cond:
            self.snapshots[step] = snapshot
            self.cond.notify_all()

    def next(self, state: TrainerState) -> ScoredBatch:
        """The next generation batch: made by weights at most max_staleness versions old; waits for it."""
        started = time.perf_counter()
        with self.cond:
            while not self.made:
                self.check_alive()
                self.cond.wait(timeout=0.5)
            made = self.made.popleft()
            self.cond.notify_all()
        waited = time.perf_counter() - started
        now = state.global_step // self.sync_every
        staleness = now - made.step // self.sync_every
        if staleness > self.staleness:  # cannot happen by the schedule; a guard for edited checkpoints
            raise RuntimeError(f"generation batch {made.index} is {staleness} versions old (max_staleness="
                               f"{self.staleness}).")
        state.generations, self.consumed_epoch = made.generations, made.epoch
        self.metrics = {"async/staleness/mean": float(staleness), "async/staleness/max": float(staleness),
                        "async/training_wait_seconds": waited + self.metrics.get("async/training_wait_seconds", 0.0)}
        return made.batch

    def step_metrics(self, started: float, ended: float) -> dict[str, float]:
        """This step's async/* metrics (this process's; defined in docs/metrics.md, "Asynchronous rollouts");
        started / ended: the step's interval (perf_counter)."""
        metrics, self.metrics = self.metrics, {}
        with self.cond:
            busy = [(max(a, started), min(b, ended)) for a, b in self.busy if b > started and a < ended]
            if self.status == "working" and self.busy_since is not None:
                busy.append((max(self.busy_since, started), ended))
            self.busy = [(a, b) for a, b in self.busy if b > ended]
            waited_for_weights, self.waited_for_weights = self.waited_for_weights, 0.0
        wait = metrics.get("async/training_wait_seconds", 0.0)
        training = [(started, ended)] if wait <= 0 else [(started + wait, ended)]
        seconds = max(ended - started, 1e-9)
        metrics.update({
            "async/training_wait_seconds": wait,
            "async/generation_wait_seconds": waited_for_weights,
            "async/generation_busy_seconds": sum(b - a for a, b in busy),
            "async/overlap": overlap_seconds(busy, training) / seconds,
            "async/dropped": float(self.dropped),
        })
        return metrics

    def quiesce(self) -> None:
        """Wait until the producer has made every batch the published weights can make and waits for newer
        ones (or has made all the run needs): nothing is half-made, the engine is free."""
        with self.cond:
            self.draining = True
            self.cond.notify_all()
            try:
                # a failed producer is not waited for; its error is raised where the learner asks for the batch
                while self.thread is not None and not self.stalled and (
                        self.status == "working" or (self.status == "waiting" and self.can_make())):
                    self.check_alive(raise_error=False)
                    self.cond.wait(timeout=0.5)
            finally:
                self.draining = False

    def close(self) -> None:
        """Stop the producer (it finishes or abandons its current call; a daemon thread never holds exit)."""
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=5.0)
            if self.thread.is_alive():
                logger.warning("The rollout producer is still inside a call (%s); it is left to finish alone.",
                               self.beat[1])
        self.thread, self.status = None, "stopped"
        self.snapshots.clear()

    def check_alive(self, raise_error: bool = True) -> None:
        """Raise the producer's error (unless not `raise_error`), or GenerationStalled when it made no progress for
        the heartbeat's limit. Called with the condition held."""
        if self.error is not None and raise_error:
            error, self.error = self.error, None
            raise error
        if self.thread is None or self.status in ("done", "stopped"):
            if not self.made and self.status == "done":
                raise RuntimeError("The rollout producer made every batch this run needs, and the loop asked for "
                                   "another.")
            return
        if self.status != "working":
            self.watch.reset()
            return
        since, doing, engine = self.beat
        idle = self.watch.idle_seconds(since, self.thread, engine)
        if idle > self.watch.limit:
            self.stalled = True  # a checkpoint after this does not wait for the producer
            raise GenerationStalled(
                f"Asynchronous rollouts: the producer made no progress for {idle:.0f} s "
                f"(heartbeat_stale_after_s={self.watch.limit:g}); it was {doing}. A hung inference server, tool or "
                "reward function stops the run here; its checkpoints in output_dir are intact (on one process the "
                "last finished step is saved now): fix the cause and resume (--resume / "
                "train(resume_from_checkpoint=True)).")
        if not self.thread.is_alive():
            raise RuntimeError("The rollout producer thread died without an error.")

    # ------------------------------------------------------------------ the producer's side
    def can_make(self) -> bool:
        """The next batch's weights are published, there is room (or a quiesce lifts the limit), the run needs it."""
        if self.last_index is not None and self.next_index > self.last_index:
            return False
        if self.scheduled(self.next_index) not in self.snapshots:
            return False
        queued = sum(len(m.batch.rows) for m in self.made)
        return self.draining or not self.made or queued < self.queue_limit

    def produce(self, stop: threading.Event) -> None:
        """The thread: make batches in order, each with its scheduled weights, until `stop` is set or done."""
        try:
            while not stop.is_set():
                with self.cond:
                    waiting_since = time.perf_counter()
                    while not self.can_make() and not stop.is_set():
                        if self.last_index is not None and self.next_index > self.last_index:
                            self.status = "done"
                        else:
                            self.status = "waiting"
                        self.cond.notify_all()
                        self.cond.wait(timeout=0.5)
                    if stop.is_set():
                        return
                    self.waited_for_weights += time.perf_counter() - waiting_since
                    index = self.next_index
                    step = self.scheduled(index)
                    snapshot = self.snapshots[step]
                    self.status, self.busy_since = "working", time.perf_counter()
                    self.pulse(f"loading the weights of step {step} for generation batch {index}")
                self.policy.load(snapshot)
                batch = self.make(index, step)
                with self.cond:
                    if stop.is_set():  # closed while making it: the run is over, or a new producer runs
                        return
                    self.made.append(Made(index, step, batch, self.generations, self.collector.sampler.epoch_progress))
                    self.busy.append((self.busy_since, time.perf_counter()))
                    self.busy_since = None
                    self.next_index = index + 1
                    self.forget_snapshots()
                    self.status = "waiting"
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - handed to the learner, which raises it
            with self.cond:
                if stop.is_set():
                    return
                self.error, self.status, self.busy_since = exc, "failed", None
                self.cond.notify_all()

    busy_since: float | None = None

    def scheduled(self, index: int) -> int:
        """The step whose weights make batch `index`: the schedule's, or the run's start when that is older."""
        return max(self.floor, weights_step(index, self.uses, self.per_step, self.staleness, self.sync_every))

    def make(self, index: int, step: int) -> ScoredBatch:
        """One generation batch through the collector; reward functions see a copy of the counters."""
        state = TrainerState(global_step=step, generations=self.generations)
        self.pulse(f"generating batch {index} with the weights of step {step}")
        batch = self.collector.collect(state)
        self.generations = state.generations
        return batch

    def pulse(self, doing: str, engine=None) -> None:
        """Progress: the heartbeat the learner reads (the collector calls it around engine and reward calls, with
        the engine while it waits on one)."""
        self.beat = (time.perf_counter(), doing, engine)

    def forget_snapshots(self) -> None:
        """Drop the snapshots no later batch is generated with."""
        needed = self.scheduled(self.next_index)
        for step in [s for s in self.snapshots if s < needed]:
            del self.snapshots[step]

    # ------------------------------------------------------------------ checkpoints
    @property
    def epoch(self) -> float:
        """Epochs of the train set the learner has taken batches from (the producer is ahead of it)."""
        return self.consumed_epoch or 0.0

    def state_dict(self) -> dict[str, Any]:
        """The data position after the made batches (quiesce() first: nothing is half-made)."""
        return {**dataclasses.asdict(self.collector.sampler.state), "generations": self.generations,
                "consumed_epoch": self.consumed_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.sampler.state, self.generations, self.consumed_epoch = read_position(state)

    @property
    def shape(self) -> dict[str, int]:
        """What a made batch's rows depend on: a resume that changes any of these cannot train on it."""
        args, geometry = self.collector.setup.args, self.collector.setup.geometry
        return {"num_generations": args.num_generations, "per_device_train_batch_size":
                args.per_device_train_batch_size, "steps_per_generation": geometry.micro_batches_per_generation,
                "num_processes": self.collector.comm.size}

    def save(self, folder: Path) -> None:
        """This process's made batches, not yet trained on (made by weights a resume no longer has)."""
        if self.made:
            made = [{f.name: getattr(m, f.name) for f in dataclasses.fields(m)} for m in self.made]
            torch.save({"shape": self.shape, "made": made}, made_path(folder, self.collector.comm.rank))

    def load(self, folder: Path) -> None:
        self.made = deque()
        saved = read_made(folder, self.collector.comm.rank)
        if saved is None:
            return
        saved.setdefault("shape", self.shape)  # written before the shape was recorded
        if saved["shape"] != self.shape:
            changed = ", ".join(f"{key} {saved['shape'].get(key)} -> {value}" for key, value in self.shape.items()
                                if saved["shape"].get(key) != value)
            self.dropped += len(saved["made"])
            logger.warning("Asynchronous rollouts: %s holds %d generation batch(es) made ahead for another batch "
                           "shape (%s); dropped, and made again with this run's.", folder, len(saved["made"]),
                           changed)
            return
        self.made = deque(Made(**made) for made in saved["made"])
        for made in self.made:  # made by weights of the saving run, whose version numbers this run's learner
            # reuses from 0 after a resume: -1 is never a learner's version, so the proximal log-probs are recomputed
            made.batch = dataclasses.replace(made.batch, weights_version=-1)


def made_path(folder: Path, rank: int) -> Path:
    """Where a checkpoint holds process `rank`'s batches made ahead."""
    return folder / f"rollouts_{rank}.pt"


def read_made(folder: Path, rank: int) -> dict[str, Any] | None:
    """A checkpoint's batches made ahead by process `rank`: {"made": [Made fields, ...], "shape": {...}} (no
    "shape" in files written before it was recorded), or None when it holds none."""
    path = made_path(folder, rank)
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=False)
    return saved if isinstance(saved, dict) else {"made": saved}


def read_position(state: dict[str, Any]) -> tuple[SamplerState, int | None, float | None]:
    """A checkpoint's data position: (the prompt sampler's state, the rounds generated and the epochs consumed, as
    an asynchronous run writes them after its batches made ahead; None in a synchronous run's checkpoint)."""
    state = dict(state)
    generations, consumed_epoch = state.pop("generations", None), state.pop("consumed_epoch", None)
    return SamplerState(**state), generations, consumed_epoch

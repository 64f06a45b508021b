"""Asynchronous rollouts: a producer thread generates the next batches while the learner trains on this one.

    pipeline = Ahead(collector, learner, ...)        # max_staleness = k > 0
    pipeline.start(state, total)                     # the thread starts; the weights of now are published
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

The producer thread owns its policy (shadow.py): a shadow copy of the model (the local engine, PEFT, frozen
parameters; one more copy of the weights, docs/async.md), or for an engine with weights of its own just the
snapshot's tensors (SnapshotPolicy). It loads the snapshot of its batch's version between its own generations:
a push never races a generation still reading older weights, and the learner never waits for the producer to
read its weights. The engine is streamed the snapshot's tensors (SnapshotPolicy), or the shadow's merged weights
(vLLM with PEFT or frozen parameters), or generates from the shadow itself (the local engine). Published
snapshots are CPU copies, dropped once no batch needs them (at most k + 1 are held). A snapshot also holds the
loop's TrainerState as it was then: reward functions get a copy of it (every field; global_step the step of the
weights that make their batch, generations the producer's count), as the synchronous loop gives its own state.

The threads. The loop's thread calls every public method; the producer thread runs `produce` (and `make`, the
collector's work). They share one `Shared`, read and written only with the condition `cond` held; the producer
never holds `cond` during a generation, and the one field written without it is the heartbeat's pulse
(heartbeat.py). The collector (its sampler, engine and shadow) is the producer's, and the loop's only while the
producer is quiesced or stopped. The producer's `Phase`:

    STOPPED -start-> WAITING -its batch's weights published, room, the run needs it-> WORKING -made-> WAITING
    WAITING -the run's last batch made-> DONE     WAITING, WORKING -raised-> FAILED     any -close-> STOPPED

    thread    call         waits for                                unblocked by
    loop      next         a made batch                             the producer making one; raised: its error
                                                                    (FAILED), a stall, DONE with none left
    loop      quiesce      the producer not WORKING and unable to   the producer entering WAITING, DONE or FAILED;
                           make another (the room limit lifted)     raised: a stall (then never waited for again)
    loop      publish      nothing (cond for a moment)              -
    loop      close        the thread ending, 5 s at most           the producer seeing its stop event: at once
                                                                    when WAITING, after its call when WORKING
    loop      check_alive  nothing (cond held; every 0.5 s while next or quiesce waits)
    producer  produce      its next batch's weights published, room publish (weights), next (room), quiesce
                           in the queue, the run needing the batch  (draining), close (stop); 0.5 s at most
    producer  make         the engine and the reward functions      their return only (cond not held): a call that
                                                                    never returns is the heartbeat's stall

quiesce() returns (without raising) once the producer is not WORKING: nothing is half-made, the collector and its
engine are free, and the made batches, the producer's `generations` and its sampler's position all stand after
the last batch made. Every batch the published snapshots can make (up to the run's last) is made, the queue
limit lifted, so the producer makes no other before the loop's next publish(). A FAILED producer is not waited
for (its error waits for next()), nor a stalled one (it may still be inside a call: nothing is guaranteed).
publish(state) adds the snapshot of the learner's weights and state at a sync point (always at start) and wakes
the producer; it changes nothing else: no made batch, no counter, no snapshot a batch still needs (the producer
drops a snapshot once no later batch is made with it).

The learner waits with a heartbeat (heartbeat.py): if, while it waits, the producer showed no progress for
heartbeat_stale_after_s, or failed, the learner raises its error and the run stops; the producer waits on nothing
without a timeout. Before an evaluation or a checkpoint the loop calls quiesce(), so evaluation has the engine to
itself and a checkpoint holds every batch that older weights made (rollouts_<rank>.pt), the data position after
them, and nothing half-made. With several processes each runs its own producer, and the producers' collectives
(the rewards' gather, the push barrier) use their own process group, never the learner's.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from grpokit.data import SamplerState
from grpokit.train.batches import ScoredBatch, TrainerState
# GenerationStalled, ShadowPolicy, shadow_copy, take_snapshot: imported from here by the trainer and the tests
from grpokit.train.heartbeat import GenerationStalled, Heartbeat  # noqa: F401
from grpokit.train.shadow import ShadowPolicy, Snapshot, shadow_copy, take_snapshot  # noqa: F401

logger = logging.getLogger("grpokit")


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


# ---------------------------------------------------------------------- the pipeline
class Phase(enum.Enum):
    """What the producer thread is doing (the module docstring has the transitions)."""

    STOPPED = "stopped"  # no thread: before start(), after close()
    WAITING = "waiting"  # for its next batch's weights, room in the queue, or a quiesce to let it make more
    WORKING = "working"  # loading a snapshot (into the shadow) and making a batch, `cond` not held
    DONE = "done"  # made every batch the run needs
    FAILED = "failed"  # raised; the error waits in Shared.error for the loop


@dataclasses.dataclass
class Made:
    """A batch the producer made: its index, the step whose weights made it, the batch, and the rounds generated
    and epochs of prompts used up to it (what the learner's counters read when it takes the batch)."""

    index: int
    step: int
    batch: ScoredBatch
    generations: int
    epoch: float


@dataclasses.dataclass
class Shared:
    """Everything both threads touch, read and written only with Ahead.cond held (module docstring)."""

    phase: Phase = Phase.STOPPED
    made: deque[Made] = dataclasses.field(default_factory=deque)  # finished, not yet taken by the learner
    snapshots: dict[int, Snapshot] = dataclasses.field(default_factory=dict)  # by step, while a batch needs them
    next_index: int = 0  # the next batch the producer makes
    last_index: int | None = None  # the last batch the run needs (None: unbounded)
    floor: int = 0  # no batch is made with weights older than this step's (those of the run's start)
    # rounds generated (they offset sample ids) after the last batch made: the producer counts them as it makes
    # each; the loop sets them only while no producer runs (start, load_state_dict). None: from the loop's state
    generations: int | None = None
    draining: bool = False  # a quiesce waits: the producer makes what the published weights can, the room limit lifted
    stalled: bool = False  # the heartbeat gave up on the producer (it may still be inside a call)
    error: BaseException | None = None  # the producer's, until the loop raises it
    busy: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # working intervals (perf_counter)
    busy_since: float | None = None  # when the current working interval began
    waited_for_weights: float = 0.0  # seconds WAITING since the last step's metrics


class Ahead:
    """Generate up to max_staleness versions ahead of the learner (see the module docstring).

    collector: the producer's Collector (its own Comm on a generation process group, a ShadowPolicy, its engine);
    learner: read at sync points only (take_snapshot); uses / per_step: M and A of the schedule; args: GRPOConfig
    (max_staleness, weight_sync_steps, queue_maxsize, heartbeat_stale_after_s)."""

    def __init__(self, collector, learner, uses: int, per_step: int, args) -> None:
        self.collector, self.learner, self.uses, self.per_step = collector, learner, uses, per_step
        self.staleness, self.sync_every = args.max_staleness, args.weight_sync_steps
        self.queue_limit = args.queue_maxsize
        self.policy: ShadowPolicy = collector.policy
        self.watch = Heartbeat(args.heartbeat_stale_after_s)
        collector.pulse = self.watch.pulse
        self.cond = threading.Condition()
        self.shared = Shared()
        # the loop's alone
        self.consumed_epoch: float | None = None  # epochs of prompts in the batches taken
        self.thread: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.dropped = 0
        self.metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ the learner's side
    def start(self, state: TrainerState, total_micro_batches: int | None) -> None:
        """Start the producer thread at `state` (a fresh run or a resume) and publish the weights of now."""
        taken = batches_before(state.global_step, self.uses, self.per_step)
        with self.cond:
            shared = self.shared
            shared.last_index = None if total_micro_batches is None else \
                math.ceil(total_micro_batches / self.uses) - 1
            self.keep_usable(state.global_step)
            shared.next_index = taken + len(shared.made)
            if shared.generations is None:  # a fresh run, or a checkpoint of the synchronous loop
                shared.generations = state.generations
            if self.consumed_epoch is None:
                self.consumed_epoch = state.epoch
            # batches the checkpoint did not hold (another number of processes, the synchronous loop's checkpoint)
            # are made with the weights of now: the older ones are gone
            shared.floor = state.global_step
        self.publish(state, always=True)
        self.stop_event = threading.Event()  # its own: a thread left inside a call by close() never resumes work
        with self.cond:
            self.shared.error, self.shared.phase, self.shared.stalled = None, Phase.WAITING, False
        self.thread = threading.Thread(target=self.produce, args=(self.stop_event,), name="grpokit-rollouts",
                                       daemon=True)
        self.thread.start()

    def keep_usable(self, step: int) -> None:
        """Drop made batches a run at `step` may not train on: made by weights older than the staleness bound.
        Called with `cond` held."""
        for made in list(self.shared.made):
            index_step = first_step(made.index, self.uses, self.per_step)
            if index_step // self.sync_every - made.step // self.sync_every > self.staleness or index_step < step:
                self.shared.made.remove(made)
                self.dropped += 1
                logger.warning("Asynchronous rollouts: generation batch %d (made by the weights of step %d) is "
                               "older than max_staleness=%d allows here; dropped.", made.index, made.step,
                               self.staleness)

    def publish(self, state: TrainerState, always: bool = False) -> None:
        """At a sync point (global_step a multiple of weight_sync_steps): the weights and state of now, for the
        batches that need them. Called after the step's evaluation and checkpoint (`always`: at start)."""
        step = state.global_step
        if step % self.sync_every and not always:
            return
        snapshot = take_snapshot(self.learner.unwrapped, step, self.learner.version, state)
        with self.cond:
            self.shared.snapshots[step] = snapshot
            self.cond.notify_all()

    def next(self, state: TrainerState) -> ScoredBatch:
        """The next generation batch: made by weights at most max_staleness versions old; waits for it. Sets the
        loop's state.generations to the rounds generated up to it."""
        started = time.perf_counter()
        with self.cond:
            while not self.shared.made:
                self.check_alive()
                self.cond.wait(timeout=0.5)
            made = self.shared.made.popleft()
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
            shared = self.shared
            busy = [(max(a, started), min(b, ended)) for a, b in shared.busy if b > started and a < ended]
            if shared.phase is Phase.WORKING and shared.busy_since is not None:
                busy.append((max(shared.busy_since, started), ended))
            shared.busy = [(a, b) for a, b in shared.busy if b > ended]
            waited_for_weights, shared.waited_for_weights = shared.waited_for_weights, 0.0
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
        ones (or has made all the run needs): nothing is half-made, the engine is free (module docstring)."""
        with self.cond:
            shared = self.shared
            shared.draining = True
            self.cond.notify_all()
            try:
                # a failed producer is not waited for; its error is raised where the learner asks for the batch
                while self.thread is not None and not shared.stalled and (
                        shared.phase is Phase.WORKING or (shared.phase is Phase.WAITING and self.can_make())):
                    self.check_alive(raise_error=False)
                    self.cond.wait(timeout=0.5)
            finally:
                shared.draining = False

    def close(self) -> None:
        """Stop the producer (it finishes or abandons its current call; a daemon thread never holds exit)."""
        self.stop_event.set()
        with self.cond:
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(timeout=5.0)
            if self.thread.is_alive():
                logger.warning("The rollout producer is still inside a call (%s); it is left to finish alone.",
                               self.watch.doing)
        self.thread = None
        with self.cond:
            self.shared.phase = Phase.STOPPED
            self.shared.snapshots.clear()

    def check_alive(self, raise_error: bool = True) -> None:
        """Raise the producer's error (unless not `raise_error`), or GenerationStalled when it made no progress for
        the heartbeat's limit. Called with `cond` held."""
        shared = self.shared
        if shared.error is not None and raise_error:
            error, shared.error = shared.error, None
            raise error
        if self.thread is None or shared.phase in (Phase.DONE, Phase.STOPPED):
            if not shared.made and shared.phase is Phase.DONE:
                raise RuntimeError("The rollout producer made every batch this run needs, and the loop asked for "
                                   "another.")
            return
        if shared.phase is not Phase.WORKING:
            self.watch.reset()
            return
        idle = self.watch.idle_seconds(self.thread)
        if idle > self.watch.limit:
            shared.stalled = True  # a checkpoint after this does not wait for the producer
            raise self.watch.stalled(idle)
        if not self.thread.is_alive():
            raise RuntimeError("The rollout producer thread died without an error.")

    # ------------------------------------------------------------------ the producer's side
    def can_make(self) -> bool:
        """The next batch's weights are published, there is room (or a quiesce lifts the limit), the run needs it.
        Called with `cond` held."""
        shared = self.shared
        if self.made_all():
            return False
        if self.scheduled(shared.next_index) not in shared.snapshots:
            return False
        queued = sum(len(m.batch.rows) for m in shared.made)
        return shared.draining or not shared.made or queued < self.queue_limit

    def made_all(self) -> bool:
        return self.shared.last_index is not None and self.shared.next_index > self.shared.last_index

    def produce(self, stop: threading.Event) -> None:
        """The thread: make batches in order, each with its scheduled weights, until `stop` is set or done."""
        try:
            while (work := self.wait_for_work(stop)) is not None:
                index, step, snapshot, generations = work
                self.policy.load(snapshot)
                batch, generations = self.make(index, step, snapshot, generations)
                if not self.finished(stop, Made(index, step, batch, generations,
                                                self.collector.sampler.epoch_progress)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the learner, which raises it
            with self.cond:
                if stop.is_set():
                    return
                self.shared.error, self.shared.phase, self.shared.busy_since = exc, Phase.FAILED, None
                self.cond.notify_all()

    def wait_for_work(self, stop: threading.Event) -> tuple[int, int, Snapshot, int] | None:
        """WAITING (or DONE) until the next batch can be made, then WORKING on it: (its index, the step of its
        weights, their snapshot, the rounds generated before it); None once `stop` is set."""
        with self.cond:
            shared, waiting_since = self.shared, time.perf_counter()
            while not self.can_make() and not stop.is_set():
                shared.phase = Phase.DONE if self.made_all() else Phase.WAITING
                self.cond.notify_all()
                self.cond.wait(timeout=0.5)
            if stop.is_set():
                return None
            shared.waited_for_weights += time.perf_counter() - waiting_since
            index = shared.next_index
            step = self.scheduled(index)
            shared.phase, shared.busy_since = Phase.WORKING, time.perf_counter()
            self.watch.pulse(f"loading the weights of step {step} for generation batch {index}")
            return index, step, shared.snapshots[step], shared.generations

    def make(self, index: int, step: int, snapshot: Snapshot, generations: int) -> tuple[ScoredBatch, int]:
        """One generation batch through the collector, and the rounds generated after it (the collector counts
        them in the state it is given). Reward functions get a copy of the state published with the weights."""
        state = dataclasses.replace(snapshot.state, global_step=step, generations=generations)
        self.watch.pulse(f"generating batch {index} with the weights of step {step}")
        batch = self.collector.collect(state)
        return batch, state.generations

    def finished(self, stop: threading.Event, made: Made) -> bool:
        """Hand over a made batch and go back to WAITING; False when closed meanwhile (the run is over, or a new
        producer runs: the batch is dropped)."""
        with self.cond:
            if stop.is_set():
                return False
            shared = self.shared
            shared.made.append(made)
            shared.generations = made.generations
            shared.busy.append((shared.busy_since, time.perf_counter()))
            shared.busy_since = None
            shared.next_index = made.index + 1
            self.forget_snapshots()
            shared.phase = Phase.WAITING
            self.cond.notify_all()
            return True

    def scheduled(self, index: int) -> int:
        """The step whose weights make batch `index`: the schedule's, or the run's start when that is older."""
        return max(self.shared.floor, weights_step(index, self.uses, self.per_step, self.staleness, self.sync_every))

    def forget_snapshots(self) -> None:
        """Drop the snapshots no later batch is generated with. Called with `cond` held."""
        needed = self.scheduled(self.shared.next_index)
        for step in [s for s in self.shared.snapshots if s < needed]:
            del self.shared.snapshots[step]

    # ------------------------------------------------------------------ checkpoints
    @property
    def epoch(self) -> float:
        """Epochs of the train set the learner has taken batches from (the producer is ahead of it)."""
        return self.consumed_epoch or 0.0

    def state_dict(self) -> dict[str, Any]:
        """The data position after the made batches (quiesce() first: nothing is half-made)."""
        with self.cond:
            generations = self.shared.generations
        return {**dataclasses.asdict(self.collector.sampler.state), "generations": generations,
                "consumed_epoch": self.consumed_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's data position (before start(): no producer runs)."""
        self.collector.sampler.state, generations, self.consumed_epoch = read_position(state)
        with self.cond:
            self.shared.generations = generations

    @property
    def shape(self) -> dict[str, int]:
        """What a made batch's rows depend on: a resume that changes any of these cannot train on it."""
        args, geometry = self.collector.setup.args, self.collector.setup.geometry
        return {"num_generations": args.num_generations, "per_device_train_batch_size":
                args.per_device_train_batch_size, "steps_per_generation": geometry.micro_batches_per_generation,
                "num_processes": self.collector.comm.size}

    def save(self, folder: Path) -> None:
        """This process's made batches, not yet trained on (made by weights a resume no longer has)."""
        with self.cond:
            made = [{f.name: getattr(m, f.name) for f in dataclasses.fields(m)} for m in self.shared.made]
        if made:
            torch.save({"shape": self.shape, "made": made}, made_path(folder, self.collector.comm.rank))

    def load(self, folder: Path) -> None:
        """A checkpoint's made batches (before start(): no producer runs)."""
        with self.cond:
            self.shared.made = deque()
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
        made = deque(Made(**made) for made in saved["made"])
        for each in made:  # made by weights of the saving run, whose version numbers this run's learner reuses
            # from 0 after a resume: -1 is never a learner's version, so the proximal log-probs are recomputed
            each.batch = dataclasses.replace(each.batch, weights_version=-1)
        with self.cond:
            self.shared.made = made


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

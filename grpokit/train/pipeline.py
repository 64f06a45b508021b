"""Where the loop gets its batches: the producer of ScoredBatches and the buffer of the batch being trained on.

    batch = pipeline.next(state)                  # Synchronous: generate now, with the current weights
    buffer.put(experience)                        # while buffer.left < the micro-batches the next step takes
    experience, rows = buffer.take(count)         # the micro-batches of the next optimizer step

`Synchronous` generates a batch when the last one is used up, so every batch is sampled by the weights that train
on it first (its weights_version equals the learner's). `Ahead` (grpokit/train/asynchronous.py, max_staleness > 0)
generates ahead in a thread, with weights at most max_staleness versions old; both have the same methods, which
the loop calls at the same points (start, next, quiesce before evaluation and checkpoints, publish after a step,
close), and those of Synchronous do nothing but `next`.

The rounds generated (TrainerState.generations: they offset sample ids) are counted by the pipeline, never by the
loop. Synchronous's collector counts them in the loop's state as it makes each batch (a batch made is a batch
taken: one count). Ahead's producer counts them in its own shared state as it makes batches ahead; each batch
carries the count after it, which `next` writes into the loop's state. A checkpoint holds both: trainer_state.json
the loop's (after the batches trained on), an asynchronous run's data position the producer's (after the batches
made ahead, whose sample ids a resume must not reuse); `start` takes the producer's where there is one.

The buffer hands out micro-batches in TRL's order: micro-batch k of a run is part k mod steps_per_generation of
its generation batch, and a generation batch serves steps_per_generation x num_iterations micro-batches before the
next one is generated; an optimizer step takes the next gradient_accumulation_steps of them, so when the two do
not line up a step's last micro-batches come from the next generation batch (joined into one Experience for the
step). No micro-batch is skipped or taken twice. Between steps the buffer holds at most one Experience, with how
many of its micro-batches were taken; that is part of a checkpoint (experience_<rank>.pt), so a resume mid-batch
continues on the very same completions.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from grpokit.train.asynchronous import read_made, read_position
from grpokit.train.batches import Experience, ScoredBatch, TrainerState
from grpokit.train.collector import Collector

logger = logging.getLogger("grpokit")


class Synchronous:
    """Generate the next batch when asked, with the weights of now."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.resumed_generations: int | None = None  # an asynchronous run's producer's count, from its checkpoint

    def next(self, state: TrainerState) -> ScoredBatch:
        return self.collector.collect(state)

    def start(self, state: TrainerState, total_micro_batches: int | None) -> None:
        """Nothing runs between calls. Resumed from an asynchronous run's checkpoint: the rounds generated count
        the batches it made ahead (their sample ids are not reused)."""
        if self.resumed_generations is not None:
            state.generations, self.resumed_generations = self.resumed_generations, None

    def quiesce(self) -> None:
        """Nothing is ever half-made."""

    def publish(self, state: TrainerState) -> None:
        """The collector reads the learner's weights when it generates."""

    def close(self) -> None:
        """Nothing to stop."""

    def step_metrics(self, started: float, ended: float) -> dict[str, float]:
        return {}

    def save(self, folder: Path) -> None:
        """No batch is made ahead."""

    def load(self, folder: Path) -> None:
        """A checkpoint of an asynchronous run may hold batches made ahead by older weights: not trained on here."""
        saved = read_made(folder, self.collector.comm.rank)
        if saved is not None:
            made = len(saved["made"])
            logger.warning(
                "%s holds %d generation batch(es) an asynchronous run made ahead with older weights; this run is "
                "synchronous (max_staleness=0) and drops them: their prompts are skipped this epoch. Resume with "
                "max_staleness >= 1 to train on them.", folder, made)

    @property
    def epoch(self) -> float:
        """Epochs of the train set consumed, fractional."""
        return self.collector.sampler.epoch_progress

    def state_dict(self) -> dict[str, Any]:
        """The data position (the prompt sampler's epoch and index)."""
        return dataclasses.asdict(self.collector.sampler.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.sampler.state, self.resumed_generations, _ = read_position(state)


class ExperienceBuffer:
    """The Experiences being trained on, oldest first, each with how many of its micro-batches were taken.

    micro_batches: per generation batch (steps_per_generation); passes: num_iterations; per_step:
    gradient_accumulation_steps; size: per_device_train_batch_size rows a micro-batch."""

    def __init__(self, micro_batches: int, passes: int, per_step: int, size: int, rank: int) -> None:
        self.micro_batches, self.passes, self.per_step, self.size, self.rank = micro_batches, passes, per_step, size, rank
        self.queue: list[list] = []  # [Experience, micro-batches taken]

    @property
    def experience(self) -> Experience | None:
        """The oldest Experience not used up (between steps the only one)."""
        return self.queue[0][0] if self.queue else None

    @property
    def cursor(self) -> int:
        return self.queue[0][1] if self.queue else 0

    @property
    def empty(self) -> bool:
        return not self.queue

    @property
    def left(self) -> int:
        """Micro-batches that can still be taken without a new generation batch."""
        return sum(self.micro_batches * self.passes - taken for _, taken in self.queue)

    def put(self, experience: Experience) -> None:
        self.queue.append([experience, 0])

    def take(self, count: int | None = None) -> tuple[Experience, list[slice]]:
        """The next optimizer step's `count` (default per_step) micro-batches, in order: (an Experience, its row
        slices). From several generation batches, the Experience is their micro-batches joined."""
        parts = []
        for _ in range(self.per_step if count is None else count):
            if not self.queue:
                raise RuntimeError("ExperienceBuffer.take: put() the next generation batch first (see `left`).")
            entry = self.queue[0]
            start = (entry[1] % self.micro_batches) * self.size
            parts.append((entry[0], slice(start, start + self.size)))
            entry[1] += 1
            if entry[1] == self.micro_batches * self.passes:
                self.queue.pop(0)
        if all(experience is parts[0][0] for experience, _ in parts):
            return parts[0][0], [rows for _, rows in parts]
        joined = join_rows(parts)
        return joined, [slice(k * self.size, (k + 1) * self.size) for k in range(len(parts))]

    def path(self, folder: Path) -> Path:
        return folder / f"experience_{self.rank}.pt"

    def save(self, folder: Path) -> None:
        """This process's buffered batch, when a step falls inside one."""
        if self.experience is not None:
            fields = {f.name: getattr(self.experience, f.name) for f in dataclasses.fields(self.experience)}
            torch.save({**fields, "cursor": self.cursor}, self.path(folder))  # shallow: image records stay whole

    def load(self, folder: Path) -> None:
        self.queue = []
        if self.path(folder).is_file():
            saved = torch.load(self.path(folder), weights_only=False)
            cursor = saved.pop("cursor", 0)
            self.queue = [[Experience(**saved), cursor]]


def join_rows(parts: list[tuple[Experience, slice]]) -> Experience:
    """The rows `parts` name, of several Experiences, as one: prompts left-padded and completions (and every
    per-token tensor) right-padded to the widest; padding is masked, and each micro-batch trims it away again."""
    fields = [f.name for f in dataclasses.fields(Experience)]
    joined = {}
    for name in fields:
        pieces = [getattr(experience, name) for experience, _ in parts]
        if all(piece is None for piece in pieces):
            joined[name] = None
            continue
        if any(piece is None for piece in pieces):
            raise ValueError(f"Experience.{name} is set in some generation batches of one step and not in others.")
        pieces = [piece[rows] for piece, (_, rows) in zip(pieces, parts)]
        joined[name] = sum(pieces, ()) if name == "vision" else _cat_padded(pieces, left=name.startswith("prompt"))
    return Experience(**joined)


def _cat_padded(pieces: list[torch.Tensor], left: bool) -> torch.Tensor:
    """Concatenate along rows; (n, T) pieces are zero-padded to the widest T first (on the left with `left`)."""
    if pieces[0].dim() == 1:
        return torch.cat(pieces)
    width = max(piece.shape[1] for piece in pieces)
    padded = [torch.nn.functional.pad(piece, (width - piece.shape[1], 0) if left else (0, width - piece.shape[1]))
              for piece in pieces]
    return torch.cat(padded)

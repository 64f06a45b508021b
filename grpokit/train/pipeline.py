"""Where the loop gets its batches: the producer of ScoredBatches and the buffer of the batch being trained on.

    batch = pipeline.next(state)                  # Synchronous: generate now, with the current weights
    buffer.put(experience); rows = buffer.take()  # the micro-batches of the next optimizer step

`Synchronous` is today's only producer: a batch is generated when the last one is used up, so every batch is
sampled by the weights that train on it first (its weights_version equals the learner's). A producer that
generates ahead (bounded staleness) has the same `next` and `state_dict`. The buffer keeps one Experience for
num_iterations x steps_per_generation micro-batches, gradient_accumulation_steps per optimizer step; it is part of
a checkpoint (experience_<rank>.pt), so a resume mid-batch continues on the very same completions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from grpokit.data import SamplerState
from grpokit.train.batches import Experience, ScoredBatch, TrainerState
from grpokit.train.collector import Collector


class Synchronous:
    """Generate the next batch when asked, with the weights of now."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def next(self, state: TrainerState) -> ScoredBatch:
        return self.collector.collect(state)

    @property
    def epoch(self) -> float:
        """Epochs of the train set consumed, fractional."""
        return self.collector.sampler.epoch_progress

    def state_dict(self) -> dict[str, Any]:
        """The data position (the prompt sampler's epoch and index)."""
        return dataclasses.asdict(self.collector.sampler.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collector.sampler.state = SamplerState(**state)


class ExperienceBuffer:
    """The Experience being trained on and how many of its micro-batches were consumed (`cursor`).

    micro_batches: per generation batch (steps_per_generation); passes: num_iterations; per_step:
    gradient_accumulation_steps; size: per_device_train_batch_size rows a micro-batch."""

    def __init__(self, micro_batches: int, passes: int, per_step: int, size: int, rank: int) -> None:
        self.micro_batches, self.passes, self.per_step, self.size, self.rank = micro_batches, passes, per_step, size, rank
        self.experience: Experience | None = None
        self.cursor = 0

    @property
    def empty(self) -> bool:
        return self.experience is None

    def put(self, experience: Experience) -> None:
        self.experience, self.cursor = experience, 0

    def take(self) -> list[slice]:
        """The row slices of the next optimizer step's micro-batches; the batch is let go after its last."""
        out = []
        for k in range(self.cursor, self.cursor + self.per_step):
            start = (k % self.micro_batches) * self.size
            out.append(slice(start, start + self.size))
        self.cursor += self.per_step
        return out

    def release_if_done(self) -> None:
        if self.cursor >= self.micro_batches * self.passes:
            self.experience, self.cursor = None, 0

    def path(self, folder: Path) -> Path:
        return folder / f"experience_{self.rank}.pt"

    def save(self, folder: Path) -> None:
        """This process's buffered batch, when a step falls inside one."""
        if self.experience is not None:
            torch.save({**dataclasses.asdict(self.experience), "cursor": self.cursor}, self.path(folder))

    def load(self, folder: Path) -> None:
        if not self.path(folder).is_file():
            self.experience, self.cursor = None, 0
            return
        saved = torch.load(self.path(folder), weights_only=False)
        self.cursor = saved.pop("cursor", 0)
        self.experience = Experience(**saved)

"""Comm: every collective call of the trainer's parts, in one small object.

The generation path (collector) calls `gather` once per round of completions (rewards, step rewards and the
telemetry inputs travel together) and once to move completions between processes under dynamic sampling;
telemetry calls it once per optimizer step; the learner sums a few numbers per step (token count, the
non-finite flag) and gathers entropies for top_entropy_quantile. With one process nothing communicates. Keeping
them here is what lets the generation path move onto its own process group (the asynchronous pipeline).
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.utils import gather_object


class Comm:
    """The processes of one run: rank, size and the collectives, over accelerate's process group."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator
        self.rank = accelerator.process_index
        self.size = accelerator.num_processes
        self.is_main = accelerator.is_main_process
        self.device = accelerator.device

    def gather(self, value: Any) -> list[Any]:
        """Every process's `value` (any picklable object), in rank order."""
        if self.size == 1:
            return [value]
        return gather_object([value])

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of `tensor` over processes, on this process's device."""
        tensor = tensor.to(self.device)
        return tensor if self.size == 1 else self.accelerator.reduce(tensor, "sum")

    def any(self, flag: bool) -> bool:
        """True when `flag` is true on any process (every process gets the same answer)."""
        return bool(self.sum(torch.tensor(float(flag))).item() > 0)

    def concat(self, values: torch.Tensor) -> torch.Tensor:
        """1-D non-negative values of every process, concatenated in rank order (lengths may differ)."""
        if self.size == 1:
            return values
        padded = self.accelerator.pad_across_processes(values.to(self.device), dim=0, pad_index=-1.0)
        gathered = self.accelerator.gather(padded)
        return gathered[gathered >= 0]

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()

    def for_generation(self) -> "Comm":
        """The same processes over a process group of their own (gloo, CPU objects), made once: the asynchronous
        producer's collectives then never interleave with the learner's on the default group."""
        if self.size == 1:
            return self
        if getattr(self, "_generation", None) is None:
            self._generation = GroupComm(self.accelerator, torch.distributed.new_group(backend="gloo"))
        return self._generation


class GroupComm(Comm):
    """Comm over another process group: gather and barrier (what the collector calls) use `group`."""

    def __init__(self, accelerator, group) -> None:
        super().__init__(accelerator)
        self.group = group

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(out, value, group=self.group)
        return out

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to("cpu").clone()
        torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def concat(self, values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("GroupComm serves the generation path, which gathers objects only.")

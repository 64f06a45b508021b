"""What transformers' TrainingArguments tells a script about the process it runs in, on GRPOConfig.

TRL's and open-r1's scripts read these off their GRPOConfig before the trainer exists (open-r1's grpo.py logs
`training_args.device` and `n_gpu` and sets its log level from `get_process_log_level()`), so GRPOConfig answers
them with TrainingArguments' meaning. The process facts come from accelerate's PartialState, the state the
trainer's Accelerator then shares: asking for them before the trainer is built forms the process group early,
as it does under transformers.

    device, n_gpu, world_size, process_index, local_process_index, should_log, should_save, parallel_mode
    train_batch_size, eval_batch_size, get_warmup_steps(n), get_process_log_level(), main_process_first()
    to_dict(), to_json_string(), to_sanitized_dict()
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Iterator

import torch

LOG_LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50, "passive": -1}
"""TrainingArguments' log_level names -> logging levels; "passive" (-1) leaves transformers' verbosity as it is."""


def runs_on_cpu(use_cpu: bool) -> bool:
    """Whether accelerate must be told to run on the CPU: asked for, or several processes without CUDA (accelerate
    forms a gloo process group only when told so)."""
    return use_cpu or (not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1)


def process_state(use_cpu: bool):
    """accelerate's PartialState of this process (made once, shared with the trainer's Accelerator)."""
    from accelerate import PartialState

    return PartialState(cpu=runs_on_cpu(use_cpu))


class ProcessFacts:
    """TrainingArguments' process properties and helpers; mixed into GRPOConfig (fields: use_cpu, log_level,
    log_level_replica, log_on_each_node, save_on_each_node, per_device_*_batch_size, warmup_*)."""

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return process_state(self.use_cpu).device

    @property
    def n_gpu(self) -> int:
        """GPUs this process uses: grpokit runs one device per process, so 1 on a GPU and 0 on the CPU."""
        return 0 if self.device.type == "cpu" else 1

    @property
    def world_size(self) -> int:
        return process_state(self.use_cpu).num_processes

    @property
    def process_index(self) -> int:
        return process_state(self.use_cpu).process_index

    @property
    def local_process_index(self) -> int:
        return process_state(self.use_cpu).local_process_index

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node with log_on_each_node, else of the run."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints: as should_log, with save_on_each_node."""
        return (self.local_process_index if self.save_on_each_node else self.process_index) == 0

    @property
    def parallel_mode(self):
        """transformers' ParallelMode: DISTRIBUTED with several processes, else NOT_PARALLEL."""
        from transformers.training_args import ParallelMode

        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def train_batch_size(self) -> int:
        """Completions per micro-batch of one process (per_device_train_batch_size x max(1, n_gpu))."""
        return self.per_device_train_batch_size * max(1, self.n_gpu)

    @property
    def eval_batch_size(self) -> int:
        """Completions generated at once per process in evaluation: per_device_eval_batch_size, default the
        process's share of a training generation batch."""
        size = self.per_device_eval_batch_size or (
            self.per_device_train_batch_size * self.resolved_steps_per_generation(self.world_size))
        return size * max(1, self.n_gpu)

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """warmup_steps when > 0, else ceil(num_training_steps x warmup_ratio)."""
        return self.warmup_steps if self.warmup_steps > 0 else math.ceil(num_training_steps * self.warmup_ratio)

    def get_process_log_level(self) -> int:
        """log_level on a process that logs (should_log), log_level_replica on the others; "passive" answers
        transformers' current verbosity."""
        from transformers.utils import logging as hf_logging

        level = LOG_LEVELS[(self.log_level if self.should_log else self.log_level_replica).lower()]
        return hf_logging.get_verbosity() if level == -1 else level

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """The main process (of this node with local=True) runs the block first, the others after it (e.g. a
        dataset map that writes a cache)."""
        state = process_state(self.use_cpu)
        with state.local_main_process_first() if local else state.main_process_first():
            yield

    def to_dict(self) -> dict[str, Any]:
        """{option: value} (no token to hide: hub_token is refused, grpokit reads `hf auth login` / HF_TOKEN)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """to_dict with every value a tracker takes (bool, int, float, str, tensor; others as str)."""
        allowed = (bool, int, float, str, torch.Tensor)
        return {k: v if isinstance(v, allowed) else str(v) for k, v in self.to_dict().items()}

"""The plain data that crosses the trainer's boundaries, and the counters a run carries.

    Collector --ScoredBatch--> Learner.prepare --Experience--> Learner.step --StepStats--> Telemetry

Every object here is data only (CPU tensors, lists, numbers): no models, no process group, no config. That is
what lets generation move to another thread or process (a ScoredBatch says which weight version produced it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from grpokit.rollout.engine import Rollout


@dataclass
class TrainerState:
    """Counters passed to reward functions as `trainer_state` and saved in checkpoints (transformers' names)."""

    global_step: int = 0
    max_steps: int = 0
    generations: int = 0
    epoch: float = 0.0
    num_input_tokens_seen: int = 0
    nonfinite_skips: int = 0
    consecutive_nonfinite_steps: int = 0
    entropy_coef: float = 0.0  # the entropy bonus's coefficient now (moves with use_adaptive_entropy)
    last_entropy: float = math.inf  # mean entropy of the last step's policy tokens (adaptive control reads it)
    log_history: list[dict[str, float]] = dataclasses.field(default_factory=list)  # every logged row, as TRL's
    interrupted: str | None = None  # the signal that stopped the last train() call ("SIGTERM"), else None
    best_metric: float | None = None  # metric_for_best_model's best value so far
    best_model_checkpoint: str | None = None
    pushed_to: str | None = None  # where push_to_hub published the model (None: not pushed, or the push failed)
    is_world_process_zero: bool = True  # transformers' TrainerState names, which callbacks read
    is_local_process_zero: bool = True


@dataclass(frozen=True)
class ScoredBatch:
    """One generation batch, scored: what the collector hands the learner.

    N completions on all processes together (G per prompt, groups contiguous), n = N / processes of them here.
    rows: the N dataset rows; local: this process's part of them; prompt_ids: the n prompts (as reset() may have
    extended them); rollout: the n completions (a Rollout, CPU); texts: the n decoded transcripts.
    rewards: (N, F) NaN where a function returned None; steps: per function None or the N step-reward lists
    ((token index, reward) pairs); advantages: (N,) or (N, max_completion_length) with step rewards;
    reward_stats: group_advantages' statistics of `rewards`.
    Telemetry inputs, all N: lengths (model tokens), truncated, tool_stats (N, 4) (see episode_stats); failures:
    per function, failed calls on all processes; logged_metrics: log_metric values of every process; log_extra:
    this process's log_extra columns; sampling_metrics: dynamic sampling's counts; generation_seconds.
    weights_version: the learner version the completions were sampled with. vision: the n prompts' images
    (grpokit.vision.PromptVision or None each) on a vision-language run, else None.
    """

    rows: list[int]
    local: slice
    prompt_ids: list[list[int]]
    rollout: Rollout
    texts: list[str]
    rewards: torch.Tensor
    steps: list
    advantages: torch.Tensor
    reward_stats: dict[str, Any]
    lengths: torch.Tensor
    truncated: torch.Tensor
    tool_stats: torch.Tensor
    failures: list[int]
    logged_metrics: dict[str, list[float]]
    log_extra: dict[str, list[Any]]
    sampling_metrics: dict[str, float]
    generation_seconds: float
    weights_version: int
    vision: list | None = None

    @property
    def local_rows(self) -> list[int]:
        return self.rows[self.local]


@dataclass(frozen=True)
class Experience:
    """One generation batch of this process as the update reads it, built once by Learner.prepare.

    Tensors have n = per_device_train_batch_size x steps_per_generation rows; prompts are left-padded (n, P),
    completions right-padded (n, T); advantages are (n,), or (n, T) when a reward function scored steps.
    loss_mask: completion_mask x tool_mask (x 0 for truncated completions with mask_truncated_completions);
    old_logp: pi_old when the batch is reused or was sampled by older weights, else None (pi_old = pi_theta);
    ref_logp: pi_ref when beta != 0; sampling_weights: (n, T) mismatch correction; sampling_logp: (n, T) the
    sampler's log-probs (off-policy mask with another engine); vision: each row's prompt images
    (grpokit.vision.PromptVision or None) on a vision-language run, else None.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    sampling_weights: torch.Tensor | None = None
    sampling_logp: torch.Tensor | None = None
    vision: tuple | None = None


@dataclass(frozen=True)
class Prepared:
    """What Learner.prepare measured on the way (local values, reduced by telemetry): the mismatch metrics, and
    with kl_in_reward the reward statistics and names of the rewards with the KL column added."""

    mismatch: dict[str, torch.Tensor] = field(default_factory=dict)
    reward_stats: dict[str, Any] | None = None
    reward_names: list[str] | None = None


@dataclass(frozen=True)
class StepStats:
    """One optimizer step of this process. Local sums (telemetry reduces them): loss and the entropy bonus over
    the micro-batches, token_sums (metric x its micro-batch's counted tokens, and "tokens"). Already the same on
    every process: grad_norm, skipped (a non-finite loss or gradient on any process), entropy (the step's mean
    policy-token entropy on all processes when adaptive entropy control is on and the step was taken)."""

    loss: torch.Tensor
    bonus: torch.Tensor | None
    token_sums: dict[str, torch.Tensor]
    grad_norm: float
    skipped: bool
    entropy: float | None = None

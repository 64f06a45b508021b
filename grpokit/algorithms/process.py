"""Step rewards -> per-token advantages (process supervision, DeepSeekMath section 4.1.3).

A process reward function scores the steps of a completion instead of the whole completion. Completion i of a
batch of N = B * G completions (the G completions of a prompt are contiguous) has K_i steps; step k ends at token
index j_{i,k} (inclusive) and has reward r_{i,k}. Within each group, the step rewards of all steps of all G
completions are pooled and normalised:

    r~_{i,k} = (r_{i,k} - mean_g) / s

mean_g is the mean of the pooled step rewards of i's group. The scale s follows `scale_rewards`, as for outcome
rewards (grpokit.algorithms.advantages): "group" = unbiased (Bessel) std of the group's pooled step rewards,
"batch" = unbiased std of all step rewards of the batch, "none" = 1. No epsilon in the denominator: a group with
fewer than two step rewards, or whose step rewards are all equal, gets r~ = 0 for every step.

The advantage of token t of completion i is the weighted sum of the normalised rewards of the steps that end at
or after t:

    A[i, t] = w * sum_{k : j_{i,k} >= t} r~_{i,k}

so tokens after the last step's end get 0. Computed as a scatter of r~ into column j_{i,k} of an (N, T) matrix,
then a cumulative sum from the right along T. Statistics are computed in float64; the result is float32.
The pooled normalisation is grpokit.algorithms.advantages.normalize_in_groups, applied to each group's steps.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from grpokit.algorithms.advantages import REWARD_SCALES, group_advantages, normalize_in_groups

# One completion's steps: (end_token_index, reward) pairs, or None when the function does not apply to it.
Steps = Sequence[tuple[int, float]] | None


def _flatten(steps: Sequence[Steps], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every step of the batch as flat tensors.

    Returns:
        rows (S,) int64 completion index, cols (S,) int64 end token index, values (S,) float64 reward,
        where S is the total number of steps.
    """
    rows, cols, values = [], [], []
    for i, entry in enumerate(steps):
        for end, reward in entry or ():
            if not 0 <= end < num_tokens:
                raise ValueError(
                    f"step of completion {i} ends at token index {end}, outside [0, {num_tokens - 1}]; "
                    "map character offsets with grpokit.rewards.offsets_to_token_indices first"
                )
            if not math.isfinite(reward):
                raise ValueError(f"step of completion {i} ending at token {end} has non-finite reward {reward}")
            rows.append(i)
            cols.append(int(end))
            values.append(float(reward))
    long = torch.int64
    return torch.tensor(rows, dtype=long), torch.tensor(cols, dtype=long), torch.tensor(values, dtype=torch.float64)


def _normalise(values: torch.Tensor, groups: torch.Tensor, num_groups: int, scale_rewards: str) -> torch.Tensor:
    """(r - group mean) / scale for every step; 0 for steps of groups with < 2 values or all values equal.

    The steps are packed group by group into a padded (B, S_max, 1) matrix, so the outcome-reward normalisation
    (grpokit.algorithms.advantages.normalize_in_groups, with every scale of REWARD_SCALES) applies unchanged.

    Args:
        values: (S,) float64 step rewards, S > 0; groups: (S,) int64 group index of each step, non-decreasing.
    Returns:
        (S,) float64 normalised step rewards.
    """
    counts = torch.bincount(groups, minlength=num_groups)  # (B,)
    positions = torch.arange(len(values)) - (counts.cumsum(0) - counts)[groups]  # (S,) place in its group's pool
    padded = values.new_zeros(num_groups, int(counts.max()), 1)
    scored = torch.zeros_like(padded, dtype=torch.bool)
    padded[groups, positions, 0] = values
    scored[groups, positions, 0] = True
    return normalize_in_groups(padded, scored, scale_rewards)[groups, positions, 0]


def process_advantages(
    steps: Sequence[Steps],
    group_size: int,
    num_tokens: int,
    scale_rewards: str = "group",
    weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token advantages of one process reward function (see the module docstring for the formula).

    Args:
        steps: N entries, N = B * group_size with groups contiguous; each None (the function does not apply),
            an empty list (no steps), or a list of (end_token_index, reward) pairs with end_token_index in
            [0, num_tokens - 1] (the token that completes the step) and reward a finite real number. Several
            steps may end at the same token: their normalised rewards add.
        group_size: G, completions per prompt.
        num_tokens: T, the completion length (columns) of the advantage matrix.
        scale_rewards: a name in grpokit.algorithms.advantages.REWARD_SCALES ("group", "batch", "none", or one
            registered there).
        weight: w, the reward function's weight.
    Returns:
        advantages (N, T) float32, and metrics (0-d float32 tensors):
        step_reward_mean: mean raw step reward over every step of the batch (NaN if there is none);
        steps_per_completion: number of steps divided by N (None and empty entries count as 0 steps; NaN if N = 0).
    """
    REWARD_SCALES[scale_rewards]  # a ValueError listing the choices when it is not one
    n = len(steps)
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}")
    rows, cols, values = _flatten(steps, num_tokens)
    at_step_end = torch.zeros(n, num_tokens, dtype=torch.float64)  # (N, T): r~ at each step's end token
    if values.numel():
        normalised = _normalise(values, rows // group_size, n // group_size, scale_rewards)  # (S,)
        at_step_end.index_put_((rows, cols), normalised, accumulate=True)
    advantages = at_step_end.flip(1).cumsum(1).flip(1) * weight  # (N, T): sum over steps ending at or after t
    metrics = {
        "step_reward_mean": values.mean() if values.numel() else torch.tensor(math.nan, dtype=torch.float64),
        "steps_per_completion": torch.tensor(values.numel() / n if n else math.nan),
    }
    return advantages.float(), {name: value.float() for name, value in metrics.items()}


def batch_advantages(
    rewards: torch.Tensor,
    steps: Sequence[Sequence[Steps] | None],
    weights: torch.Tensor,
    group_size: int,
    max_completion_length: int,
    multi_objective_aggregation: str = "sum_then_normalize",
    scale_rewards: str = "group",
    advantage_estimator: str = "grpo",
) -> tuple[torch.Tensor, dict]:
    """Advantages of a whole batch from its outcome rewards and, per step-scoring function, its step rewards.

    Args:
        rewards: (N, F) float, NaN where a function returned None (see group_advantages).
        steps: per function, None (an outcome function) or N step lists (None where it does not apply).
        weights: (F,) weight of each function; a step-scoring function's weight scales its per-token part.
    Returns:
        advantages (N,) when no function scored steps, else (N, max_completion_length): the outcome advantage
        broadcast over tokens plus each step-scoring function's process_advantages; and group_advantages'
        statistics with "step_reward_mean": {function index: mean step reward}.
    """
    advantages, stats = group_advantages(
        rewards, weights, group_size, multi_objective_aggregation, scale_rewards, advantage_estimator
    )
    stats["step_reward_mean"] = {}
    for f, per_completion in enumerate(steps):
        if per_completion is None:
            continue
        step_adv, step_stats = process_advantages(
            per_completion, group_size, max_completion_length, scale_rewards, float(weights[f])
        )
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(-1).expand(-1, max_completion_length)
        advantages = advantages + step_adv.to(advantages.dtype)
        stats["step_reward_mean"][f] = step_stats["step_reward_mean"]
    return advantages, stats

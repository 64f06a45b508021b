"""Rewards -> group-relative advantages.

Input is the reward matrix R[N, F]: N = B * G completions (the G completions of a prompt are contiguous), F reward
functions, NaN where a function returned None ("does not apply to this sample"). NaN is never read as 0: it is
left out of every mean, std and sum. With weights w[F]:

    sum_then_normalize:  r_i = sum_{f applicable} w_f R[i, f];        A_i = (r_i - mean_g r) / s
    normalize_then_sum:  z[i, f] = (R[i, f] - mean_g R[., f]) / s_f;  A_i = sum_{f applicable} w_f z[i, f]

mean_g is the mean over the scored completions of i's group. The scale s follows `scale_rewards`:
"group" = std of the group (GRPO), "batch" = std over the whole batch (more robust when groups are small),
"none" = 1 (Dr. GRPO: no difficulty bias from dividing by a small std). Stds are unbiased (Bessel-corrected,
as torch.std and TRL). Departures, on purpose:
- no epsilon in the denominator: a group whose scored rewards are all equal gets advantage exactly 0, every other
  group is divided by its true std, so advantages are exactly invariant to a positive affine map of the rewards;
- a completion that no function could score gets advantage 0 and does not enter its group's mean or std.
"""

from __future__ import annotations

from typing import Callable

import torch

_NEG_INF = float("-inf")
_POS_INF = float("inf")


def _group_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Masked mean, unbiased std and "all equal" flag along dim 1.

    Args:
        x: (B, G, K) values; mask: (B, G, K) bool, True where x is a real value.
    Returns:
        mean (B, 1, K), std (B, 1, K), flat (B, 1, K) bool: True when fewer than two distinct values are present.
    """
    count = mask.sum(1, keepdim=True)  # (B, 1, K)
    zeros = torch.zeros_like(x)
    mean = torch.where(mask, x, zeros).sum(1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(mask, x - mean, zeros)
    std = (centred.pow(2).sum(1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    highest = torch.where(mask, x, torch.full_like(x, _NEG_INF)).amax(1, keepdim=True)
    lowest = torch.where(mask, x, torch.full_like(x, _POS_INF)).amin(1, keepdim=True)
    flat = ~(highest > lowest)
    return mean, std, flat


def _scale_group(x, mask, std, flat):
    return std


def _scale_batch(x, mask, std, flat):
    """One std over every scored value of the batch, per reward column: (B, G, K) -> (1, 1, K)."""
    batch_mask = mask.reshape(1, -1, mask.shape[-1])
    _, batch_std, _ = _group_stats(x.reshape(1, -1, x.shape[-1]), batch_mask)
    return batch_std


def _scale_none(x, mask, std, flat):
    return torch.ones_like(std)


REWARD_SCALES: dict[str, Callable] = {"group": _scale_group, "batch": _scale_batch, "none": _scale_none}


def normalize_in_groups(x: torch.Tensor, mask: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """(x - group mean) / scale over scored entries; 0 where unscored or the group is flat.

    Args:
        x: (B, G, K); mask: (B, G, K) bool; scale_rewards: a key of REWARD_SCALES.
    Returns:
        (B, G, K) normalised values.
    """
    mean, std, flat = _group_stats(x, mask)
    scale = REWARD_SCALES[scale_rewards](x, mask, std, flat)
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    normalised = (x - mean) / safe_scale
    keep = mask & ~flat
    return torch.where(keep, normalised, torch.zeros_like(x))


def _sum_then_normalize(rewards, applicable, weights, scale_rewards):
    """(B, G, F) -> (B, G): weighted sum over applicable functions, then normalise within the group."""
    total = torch.where(applicable, rewards * weights, torch.zeros_like(rewards)).sum(-1, keepdim=True)
    scored = applicable.any(-1, keepdim=True)
    return normalize_in_groups(total, scored, scale_rewards).squeeze(-1)


def _normalize_then_sum(rewards, applicable, weights, scale_rewards):
    """(B, G, F) -> (B, G): normalise each function within the group, then weighted sum over applicable ones."""
    z = normalize_in_groups(torch.nan_to_num(rewards), applicable, scale_rewards)
    return torch.where(applicable, z * weights, torch.zeros_like(z)).sum(-1)


MULTI_OBJECTIVE_AGGREGATIONS: dict[str, Callable] = {
    "sum_then_normalize": _sum_then_normalize,
    "normalize_then_sum": _normalize_then_sum,
}


def _nan_mean_std(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased std of the non-NaN entries of each column: (N, F) -> (F,), (F,); NaN if none."""
    mask = ~torch.isnan(values)
    count = mask.sum(0)
    mean = torch.where(mask, values, 0.0).sum(0) / count
    var = torch.where(mask, values - mean, 0.0).pow(2).sum(0) / (count - 1).clamp(min=1)
    return mean, torch.where(count > 1, var.sqrt(), torch.zeros_like(var))


def group_advantages(
    rewards: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    multi_objective_aggregation: str = "sum_then_normalize",
    scale_rewards: str = "group",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantage of every completion, and the reward statistics worth logging.

    Args:
        rewards: (N, F) float, NaN where a function returned None; N = B * group_size, groups contiguous.
        weights: (F,) weight of each reward function.
        group_size: G, completions per prompt.
        multi_objective_aggregation: a key of MULTI_OBJECTIVE_AGGREGATIONS.
        scale_rewards: a key of REWARD_SCALES.
    Returns:
        advantages (N,) in the rewards' float dtype, and metrics (tensors):
        reward (N,): weighted sum of the applicable rewards (NaN if none applied);
        reward_group_std (B,): unbiased std of `reward` within each group;
        frac_reward_zero_std (): fraction of groups whose `reward` values are all equal;
        reward_func_mean (F,), reward_func_std (F,): over applicable samples only.
    """
    n, f = rewards.shape
    if n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    weights = weights.to(rewards)
    grouped = rewards.reshape(n // group_size, group_size, f)  # (B, G, F)
    applicable = ~torch.isnan(grouped)
    advantages = MULTI_OBJECTIVE_AGGREGATIONS[multi_objective_aggregation](
        grouped, applicable, weights, scale_rewards
    )

    scored = applicable.any(-1, keepdim=True)  # (B, G, 1)
    total = torch.where(applicable, grouped * weights, torch.zeros_like(grouped)).sum(-1, keepdim=True)
    _, total_std, total_flat = _group_stats(total, scored)
    func_mean, func_std = _nan_mean_std(rewards)
    metrics = {
        "reward": torch.where(scored, total, torch.full_like(total, float("nan"))).reshape(n),
        "reward_group_std": total_std.reshape(-1),
        "frac_reward_zero_std": total_flat.float().mean(),
        "reward_func_mean": func_mean,
        "reward_func_std": func_std,
    }
    return advantages.reshape(n), metrics

"""Rewards -> group-relative advantages.

Input is the reward matrix R[N, F]: N = B * G completions (the G completions of a prompt are contiguous), F reward
functions, NaN where a function returned None ("does not apply to this sample"). NaN is never read as 0: it is
left out of every mean, std and sum. With weights w[F]:

    sum_then_normalize:  r_i = sum_{f applicable} w_f R[i, f];  A_i = E(r)_i
    normalize_then_sum:  s_i = sum_{f applicable} w_f E(R[., f])_i;  A_i = (s_i - mean_batch s) / std_batch(s)

E is the advantage estimator (`advantage_estimator`, ADVANTAGE_ESTIMATORS, verl's names). With n the number of
scored completions of i's group and mean_g their mean:

    grpo:                          E(x)_i = (x_i - mean_g x) / s
    rloo:                          E(x)_i = (x_i - mean_{j != i} x_j) / s = n / (n - 1) * (x_i - mean_g x) / s
    reinforce_plus_plus_baseline:  c_i = x_i - mean_g x;   E(x)_i = c_i / std_batch(c)

The scale s follows `scale_rewards` (grpo and rloo): "group" = std of the group (GRPO), "batch" = std of x over
the whole batch (more robust when groups are small), "none" = 1 (Dr. GRPO is grpo with "none"; verl's RLOO is
rloo with "none"). REINFORCE++-baseline centres in the group and divides by the std of the centred values over
the batch (it fixes its own scale, so it takes no scale_rewards). The batch mean of c is exactly 0 (every group's
centred values sum to 0), so no second centring is needed; verl whitens token-weighted, grpokit per completion.
Stds are unbiased (Bessel-corrected, as torch.std and TRL). Departures, on purpose:
- no epsilon in the denominator: a group whose scored rewards are all equal gets advantage exactly 0, every other
  group is divided by its true std, so advantages are exactly invariant to a positive affine map of the rewards;
- a completion that no function could score gets advantage 0 and does not enter its group's mean or std;
- normalize_then_sum (GDPO; TRL's option of the same name) whitens the sum over the batch's scored completions
  as GDPO and TRL do, but its per-function step is E with `scale_rewards` (TRL always divides each function by its
  group std there and ignores scale_rewards); with the default "group" the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from grpokit.registry import Registry

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


REWARD_SCALES = Registry("scale_rewards")
REWARD_SCALES.register("group", _scale_group)
REWARD_SCALES.register("batch", _scale_batch)
REWARD_SCALES.register("none", _scale_none)


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: fn(x, mask, scale_rewards) -> (B, G, K) advantages, 0 where mask is False.

    x: (B, G, K) rewards (K reward columns); mask: (B, G, K) bool, True where scored. uses_scale_rewards: False
    when the estimator fixes its own scale (scale_rewards must then stay "group", its default)."""

    fn: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
    name: str
    uses_scale_rewards: bool = True

    def __call__(self, x: torch.Tensor, mask: torch.Tensor, scale_rewards: str) -> torch.Tensor:
        return self.fn(x, mask, scale_rewards)


ADVANTAGE_ESTIMATORS = Registry("advantage_estimator", AdvantageEstimator)


def _scaled(centred, x, mask, std, flat, scale_rewards):
    """centred / scale over scored, non-flat entries; 0 elsewhere. All (B, G, K)."""
    scale = REWARD_SCALES[scale_rewards](x, mask, std, flat)
    safe_scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(mask & ~flat, centred / safe_scale, torch.zeros_like(x))


@ADVANTAGE_ESTIMATORS.register("grpo")
def normalize_in_groups(x: torch.Tensor, mask: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """GRPO: (x - group mean) / scale over scored entries; 0 where unscored or the group is flat. (B, G, K)."""
    mean, std, flat = _group_stats(x, mask)
    return _scaled(x - mean, x, mask, std, flat, scale_rewards)


@ADVANTAGE_ESTIMATORS.register("rloo")
def leave_one_out(x: torch.Tensor, mask: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """RLOO: x_i minus the mean of the other scored members of its group, then / scale. (B, G, K)."""
    mean, std, flat = _group_stats(x, mask)
    count = mask.sum(1, keepdim=True).to(x.dtype)
    centred = (x - mean) * count / (count - 1).clamp(min=1)
    return _scaled(centred, x, mask, std, flat, scale_rewards)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline", uses_scale_rewards=False)
def reinforce_plus_plus_baseline(x: torch.Tensor, mask: torch.Tensor, scale_rewards: str) -> torch.Tensor:
    """REINFORCE++-baseline: group-mean baseline, then / std over the batch of the centred values. (B, G, K)."""
    mean, _, flat = _group_stats(x, mask)
    centred = torch.where(mask, x - mean, torch.zeros_like(x))
    batch_mask = mask.reshape(1, -1, mask.shape[-1])
    _, batch_std, batch_flat = _group_stats(centred.reshape(1, -1, x.shape[-1]), batch_mask)
    safe = torch.where(batch_std > 0, batch_std, torch.ones_like(batch_std))
    return torch.where(mask & ~flat & ~batch_flat, centred / safe, torch.zeros_like(x))


MULTI_OBJECTIVE_AGGREGATIONS = Registry("multi_objective_aggregation")


@MULTI_OBJECTIVE_AGGREGATIONS.register("sum_then_normalize")
def _sum_then_normalize(rewards, applicable, weights, estimator, scale_rewards):
    """(B, G, F) -> (B, G): weighted sum over applicable functions, then the estimator within the group."""
    total = torch.where(applicable, rewards * weights, torch.zeros_like(rewards)).sum(-1, keepdim=True)
    scored = applicable.any(-1, keepdim=True)
    return estimator(total, scored, scale_rewards).squeeze(-1)


def whiten_over_batch(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over every masked entry of the batch, per column; 0 where unmasked or all equal.
    (B, G, K) -> (B, G, K)."""
    flat_x, flat_mask = x.reshape(1, -1, x.shape[-1]), mask.reshape(1, -1, mask.shape[-1])
    mean, std, flat = _group_stats(flat_x, flat_mask)
    safe = torch.where(std > 0, std, torch.ones_like(std))
    return torch.where(mask & ~flat, (x - mean) / safe, torch.zeros_like(x))


@MULTI_OBJECTIVE_AGGREGATIONS.register("normalize_then_sum")
def _normalize_then_sum(rewards, applicable, weights, estimator, scale_rewards):
    """(B, G, F) -> (B, G): GDPO. The estimator on each function within the group, the weighted sum over the
    applicable functions, then that sum whitened over the batch's scored completions."""
    z = estimator(torch.nan_to_num(rewards), applicable, scale_rewards)
    total = torch.where(applicable, z * weights, torch.zeros_like(z)).sum(-1, keepdim=True)
    return whiten_over_batch(total, applicable.any(-1, keepdim=True)).squeeze(-1)


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
    advantage_estimator: str = "grpo",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group-relative advantage of every completion, and the reward statistics worth logging.

    Args:
        rewards: (N, F) float, NaN where a function returned None; N = B * group_size, groups contiguous.
        weights: (F,) weight of each reward function.
        group_size: G, completions per prompt.
        multi_objective_aggregation: a key of MULTI_OBJECTIVE_AGGREGATIONS.
        scale_rewards: a key of REWARD_SCALES.
        advantage_estimator: a key of ADVANTAGE_ESTIMATORS.
    Returns:
        advantages (N,) in the rewards' float dtype (float32 for integer rewards), computed in float64 so that
        large rewards cannot overflow the group statistics, and metrics (tensors, the same dtype):
        reward (N,): weighted sum of the applicable rewards (NaN if none applied);
        reward_group_std (B,): unbiased std of `reward` within each group;
        frac_reward_zero_std (): fraction of groups whose `reward` values are all equal;
        reward_func_mean (F,), reward_func_std (F,): over applicable samples only.
    """
    n, f = rewards.shape
    if n % group_size:
        raise ValueError(f"{n} completions do not split into groups of {group_size}")
    dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    # float64 inside: squared deviations of rewards near float32's range (1e20 and up) must not overflow the std
    rewards = rewards.double()
    weights = weights.to(rewards)
    grouped = rewards.reshape(n // group_size, group_size, f)  # (B, G, F)
    applicable = ~torch.isnan(grouped)
    advantages = MULTI_OBJECTIVE_AGGREGATIONS[multi_objective_aggregation](
        grouped, applicable, weights, ADVANTAGE_ESTIMATORS[advantage_estimator], scale_rewards
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
    metrics = {key: value.to(dtype) for key, value in metrics.items()}
    return advantages.reshape(n).to(dtype), metrics

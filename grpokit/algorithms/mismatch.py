"""Train/inference mismatch: weights that correct for sampling with one program (vLLM) and training with another.

The tokens of a completion are drawn by the sampler with log-probs s_t; the trainer recomputes them on the same
weights as l_t ("old" log-probs, at generation time). Kernels and precision differ, so l != s, and the batch is
slightly off-policy. Importance sampling (TRL's names, after "Your efficient RL framework secretly brings you
off-policy RL training") weights each token's policy-gradient term by a ratio rho, with m the completion mask:

    token modes:     rho_t = exp(l_t - s_t)                        one ratio per token
    sequence modes:  rho   = exp(sum_t m_t (l_t - s_t))            one ratio per completion, for all its tokens
    *_truncate:      w = clamp(rho, C_min, C_max)                  (a missing bound is no bound)
    *_mask:          w = rho if C_min <= rho <= C_max else 0

as in TRL 1.16 (`vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`). The weights are constants (no
gradient); they multiply only the clipped surrogate, not the KL penalty (losses.policy_loss). Positions with m = 0
(padding, or tokens the sampler could not score: NaN) contribute a log-ratio of 0, so they never reach a
sequence ratio or a metric.

Metrics (over tokens with m = 1, pooled over the batch):
    sampling/sampling_logp_difference/mean, /max     |l_t - s_t|                               (TRL's names)
    sampling/importance_sampling_ratio/min, /mean, /max   w over tokens (token modes) or over completions
                                                     (sequence modes), after truncation or masking  (TRL's names)
    sampling/kl_sampler_trainer                      mean of k3 = exp(l - s) - (l - s) - 1, an unbiased,
                                                     non-negative estimate of KL(sampler || trainer) from the
                                                     sampler's own draws (grpokit's addition)
    sampling/is_corrected_fraction                   fraction of tokens (token modes) or completions (sequence
                                                     modes) whose ratio fell outside [C_min, C_max], i.e. was
                                                     truncated or masked (grpokit's addition)
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from grpokit.algorithms.logprobs import masked_mean


def _log_ratios(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) l - s on counted tokens, 0 elsewhere (padding may hold anything, even NaN or -inf)."""
    valid = mask.bool() & torch.isfinite(sampler_logp) & torch.isfinite(trainer_logp)
    return torch.where(valid, trainer_logp.double() - sampler_logp.double(), 0.0)  # (B, T) float64


def _truncate(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def _mask(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return torch.where((ratio < low) | (ratio > high), torch.zeros_like(ratio), ratio)


# name -> (sequence level?, constraint). The only list of modes.
IS_CORRECTION_MODES: dict[str, tuple[bool, Callable[..., torch.Tensor]]] = {
    "token_truncate": (False, _truncate),
    "token_mask": (False, _mask),
    "sequence_truncate": (True, _truncate),
    "sequence_mask": (True, _mask),
}


def mismatch_weights(
    trainer_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights for the policy-gradient term, and the mismatch metrics.

    Args:
        trainer_logp: (B, T) the trainer's log-probs of the sampled tokens, on the weights that sampled them.
        sampler_logp: (B, T) the sampler's log-probs of the same tokens.
        mask: (B, T) 1 for completion tokens, 0 for padding.
        mode: a key of IS_CORRECTION_MODES; clip_min / clip_max: the bounds C_min / C_max (None: unbounded).
    Returns:
        weights (B, T) float32 without gradient (0 at padding), and metrics (0-dim tensors, module docstring).
    """
    if mode not in IS_CORRECTION_MODES:
        raise ValueError(f"Unknown importance-sampling mode {mode!r}; choose one of: {', '.join(IS_CORRECTION_MODES)}.")
    sequence_level, constrain = IS_CORRECTION_MODES[mode]
    with torch.no_grad():
        mask = mask.to(torch.float64)
        log_ratio = _log_ratios(trainer_logp.detach(), sampler_logp.detach(), mask)  # (B, T)
        if sequence_level:
            log_ratio = log_ratio.sum(-1, keepdim=True)  # (B, 1)
        ratio = torch.exp(log_ratio)
        weight = constrain(ratio, clip_min, clip_max)
        corrected = (weight != ratio).to(torch.float64)
        if sequence_level:
            rows = mask.sum(-1, keepdim=True) > 0  # (B, 1) completions with at least one token
            kept, changed = weight[rows], corrected[rows]
        else:
            kept, changed = weight[mask.bool()], corrected[mask.bool()]
        metrics = mismatch_metrics(trainer_logp, sampler_logp, mask)
        metrics.update(_ratio_stats(kept, changed))
        weights = (weight.expand_as(mask) * mask).float()  # (B, T)
    return weights, metrics


def _ratio_stats(weights: torch.Tensor, changed: torch.Tensor) -> dict[str, torch.Tensor]:
    """min / mean / max of a flat tensor of weights and the mean of `changed`; 0 when empty."""
    if weights.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32)
        return {f"sampling/importance_sampling_ratio/{k}": zero for k in ("min", "mean", "max")} | {
            "sampling/is_corrected_fraction": zero
        }
    return {
        "sampling/importance_sampling_ratio/min": weights.min().float(),
        "sampling/importance_sampling_ratio/mean": weights.mean().float(),
        "sampling/importance_sampling_ratio/max": weights.max().float(),
        "sampling/is_corrected_fraction": changed.mean().float(),
    }


def mismatch_metrics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's, over tokens with mask 1 (module docstring).

    Args:
        trainer_logp, sampler_logp, mask: (B, T) as in mismatch_weights.
    Returns:
        sampling/sampling_logp_difference/mean and /max, sampling/kl_sampler_trainer (0-dim float32; 0 when empty).
    """
    with torch.no_grad():
        valid = mask.bool() & torch.isfinite(sampler_logp) & torch.isfinite(trainer_logp)
        diff = _log_ratios(trainer_logp.detach(), sampler_logp.detach(), valid)  # (B, T) l - s, 0 off the mask
        k3 = torch.exp(diff) - diff - 1.0
        gap = diff.abs()[valid]
        return {
            "sampling/sampling_logp_difference/mean": masked_mean(diff.abs(), valid.double()).float(),
            "sampling/sampling_logp_difference/max": (gap.max() if gap.numel() else torch.zeros((), dtype=torch.float64)).float(),
            "sampling/kl_sampler_trainer": masked_mean(k3, valid.double()).float(),
        }

"""Train/inference mismatch: weights that correct for sampling with one program (vLLM) and training with another.

The tokens of a completion are drawn by the sampler with log-probs s_t; the trainer recomputes them on the same
weights as l_t ("old" log-probs, at generation time). Kernels and precision differ, so l != s, and the batch is
slightly off-policy. Importance sampling (TRL's names, after "Your efficient RL framework secretly brings you
off-policy RL training") weights each token's policy-gradient term by a ratio rho, with m the completion mask:

    token modes:     rho_t = exp(m_t (l_t - s_t))                  one ratio per token
    sequence modes:  rho   = exp(sum_t m_t (l_t - s_t))            one ratio per completion, for all its tokens
                                                                   (the product of the token ratios, not a mean)
    *_truncate:      w = clamp(rho, C_min, C_max)                  (a missing bound is no bound)
    *_mask:          w = rho if C_min <= rho <= C_max else 0

as in TRL 1.16.0 (its grpo_config.py and grpo_trainer.py; the options date from 1.6): `vllm_importance_sampling_correction`,
default True; `vllm_importance_sampling_mode`, default "sequence_mask"; `vllm_importance_sampling_clip_max` = C_max,
default 3.0; `vllm_importance_sampling_clip_min` = C_min, default None; `vllm_importance_sampling_cap` is TRL's
deprecated alias of clip_max). The weights are constants (no gradient); they multiply the clipped surrogate of each
token before beta * KL is added, so the KL penalty is not reweighted (losses.policy_loss), as in TRL.

Where grpokit departs from TRL, and why:
  * Positions with m = 0 may hold anything (NaN, +-inf) in either input: l - s is taken with torch.where, never
    as (l - s) * m, so garbage never reaches a ratio, a weight or a metric (in TRL, NaN * 0 = NaN would).
  * A counted token (m = 1) whose l or s is not finite has no defined ratio: it is treated as padding (weight 0,
    left out of its sequence's ratio and of every metric) rather than poisoning the loss with NaN.
  * Weights are 0 at padding (TRL leaves exp(0) = 1 or the row's ratio there; the loss masks them either way).
  * Sequence-mode ratio statistics are taken over completions with at least one counted token; TRL also counts
    empty rows, whose ratio is exp(0) = 1.
  * Two metrics TRL does not log (below).

Metrics (0-dim tensors, over counted tokens, pooled over the batch; 0 when there are none):
    sampling/sampling_logp_difference/mean, /max     |l_t - s_t|                               (TRL's names)
    sampling/importance_sampling_ratio/min, /mean, /max   w over tokens (token modes) or over completions
                                                     (sequence modes), after truncation or masking  (TRL's names)
    sampling/kl_sampler_trainer                      mean of k3 = exp(l - s) - (l - s) - 1 (grpokit's addition).
                                                     The tokens are the sampler's draws, so with rho = p_trainer /
                                                     p_sampler, E_sampler[rho] = 1 and E_sampler[k3] =
                                                     E_sampler[log p_sampler - log p_trainer] = KL(sampler || trainer):
                                                     an unbiased, non-negative estimate of that direction. (The
                                                     other sign, r = s - l, would need E_sampler[p_s / p_t] = 1,
                                                     which does not hold: biased.)
    sampling/is_corrected_fraction                   fraction of tokens (token modes) or of completions (sequence
                                                     modes) whose ratio fell outside [C_min, C_max], i.e. was
                                                     truncated to a bound or masked to 0 (grpokit's addition)
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch

from grpokit.algorithms.logprobs import masked_mean
from grpokit.registry import Registry


def _counted(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: mask 1 and both log-probs finite."""
    return mask.bool() & torch.isfinite(trainer_logp) & torch.isfinite(sampler_logp)


def _log_ratios(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """(B, T) float64 l - s on counted tokens, exactly 0 elsewhere (whatever the inputs hold there)."""
    diff = trainer_logp.detach().double() - sampler_logp.detach().double()  # (B, T), may be NaN off `counted`
    return torch.where(counted, diff, torch.zeros_like(diff))  # (B, T)


def _truncate(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """clamp(rho, C_min, C_max); a None bound is no bound. Shape kept."""
    if clip_min is None and clip_max is None:
        return ratio
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def _mask(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """rho inside [C_min, C_max] (bounds included), 0 outside; a None bound is no bound. Shape kept."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return torch.where((ratio < low) | (ratio > high), torch.zeros_like(ratio), ratio)


Constraint = Callable[[torch.Tensor, float | None, float | None], torch.Tensor]


class MismatchMode(NamedTuple):
    """A registered correction mode: `constrain(ratio, clip_min, clip_max)` -> weights of the same shape, applied
    to one ratio per token, or (per_sequence) one ratio per completion. A tuple, so mode[0] is per_sequence."""

    per_sequence: bool
    constrain: Constraint
    name: str


def _mode(constrain: Constraint, name: str, per_sequence: bool = False) -> MismatchMode:
    return MismatchMode(per_sequence, constrain, name)


# The only list of the modes (vllm_importance_sampling_mode). A mode of your own: a constraint function registered
# with @IS_CORRECTION_MODES.register("name", per_sequence=True|False), or named by import path (then per token
# unless a decorator registered it).
IS_CORRECTION_MODES = Registry(
    "vllm_importance_sampling_mode", _mode, expected="a function constrain(ratio, clip_min, clip_max) -> weights"
)
IS_CORRECTION_MODES.register("token_truncate", _truncate)
IS_CORRECTION_MODES.register("token_mask", _mask)
IS_CORRECTION_MODES.register("sequence_truncate", _truncate, per_sequence=True)
IS_CORRECTION_MODES.register("sequence_mask", _mask, per_sequence=True)


def _out_dtype(trainer_logp: torch.Tensor) -> torch.dtype:
    """float64 in -> float64 out; anything narrower (fp32, bf16) -> float32."""
    return torch.promote_types(trainer_logp.dtype, torch.float32)


def mismatch_weights(
    trainer_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights for the policy-gradient term, and the mismatch metrics (module docstring).

    Args:
        trainer_logp: (B, T) the trainer's log-probs of the sampled tokens, on the weights that sampled them.
        sampler_logp: (B, T) the sampler's log-probs of the same tokens.
        mask: (B, T) 1 for completion tokens that count, 0 for padding (which may hold anything, NaN included).
        mode: a name in IS_CORRECTION_MODES, or an import path to a mode of your own.
        clip_min, clip_max: the bounds C_min, C_max (None: no bound on that side).
    Returns:
        weights (B, T) without gradient, 0 at padding, float64 for float64 inputs and float32 otherwise; and the
        metrics, 0-dim tensors of the same dtype.
    Raises:
        ValueError: unknown mode (the message lists the valid ones).
    """
    sequence_level, constrain, _ = IS_CORRECTION_MODES[mode]
    dtype = _out_dtype(trainer_logp)
    with torch.no_grad():
        counted = _counted(trainer_logp, sampler_logp, mask)  # (B, T)
        log_ratio = _log_ratios(trainer_logp, sampler_logp, counted)  # (B, T)
        if sequence_level:
            log_ratio = log_ratio.sum(-1, keepdim=True)  # (B, 1)
            units = counted.any(-1, keepdim=True)  # (B, 1) completions with a counted token
        else:
            units = counted  # (B, T)
        ratio = torch.exp(log_ratio)  # (B, T) or (B, 1)
        weight = constrain(ratio, clip_min, clip_max)  # (B, T) or (B, 1)
        changed = (weight != ratio)[units].double()  # (U,)
        metrics = mismatch_metrics(trainer_logp, sampler_logp, mask)
        metrics.update(_ratio_stats(weight[units], changed, dtype))
        weights = torch.where(counted, weight.expand_as(counted), weight.new_zeros(()))  # (B, T)
    return weights.to(dtype), metrics


def _ratio_stats(weights: torch.Tensor, changed: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """min / mean / max of a flat (U,) tensor of weights, and the mean of `changed` (U,); all 0 when U = 0."""
    if weights.numel() == 0:
        zero = torch.zeros((), dtype=dtype, device=weights.device)
        return {
            "sampling/importance_sampling_ratio/min": zero,
            "sampling/importance_sampling_ratio/mean": zero.clone(),
            "sampling/importance_sampling_ratio/max": zero.clone(),
            "sampling/is_corrected_fraction": zero.clone(),
        }
    return {
        "sampling/importance_sampling_ratio/min": weights.min().to(dtype),
        "sampling/importance_sampling_ratio/mean": weights.mean().to(dtype),
        "sampling/importance_sampling_ratio/max": weights.max().to(dtype),
        "sampling/is_corrected_fraction": changed.mean().to(dtype),
    }


def mismatch_metrics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the sampler's log-probs are from the trainer's, over counted tokens; for logging with the
    correction off (module docstring).

    Args:
        trainer_logp, sampler_logp, mask: (B, T) as in mismatch_weights.
    Returns:
        sampling/sampling_logp_difference/mean and /max, sampling/kl_sampler_trainer: 0-dim tensors (float64 for
        float64 inputs, float32 otherwise), 0 when no token counts.
    """
    dtype = _out_dtype(trainer_logp)
    with torch.no_grad():
        counted = _counted(trainer_logp, sampler_logp, mask)  # (B, T)
        diff = _log_ratios(trainer_logp, sampler_logp, counted)  # (B, T) l - s, 0 off `counted`
        k3 = torch.exp(diff) - diff - 1.0  # (B, T), 0 off `counted`
        gap = diff.abs()  # (B, T), >= 0, and 0 off `counted` so it never raises the max
        weight = counted.double()
        return {
            "sampling/sampling_logp_difference/mean": masked_mean(gap, weight).to(dtype),
            "sampling/sampling_logp_difference/max": (gap.amax() if gap.numel() else gap.new_zeros(())).to(dtype),
            "sampling/kl_sampler_trainer": masked_mean(k3, weight).to(dtype),
        }

"""The GRPO policy loss: clipped importance-sampling surrogate + beta * k3 KL, aggregated by `loss_type`.

Per token t of completion i, with advantage A_i and log-ratio l_{i,t} = log pi_theta - log pi_old:

    w_{i,t} = exp(l_{i,t})                                  importance_sampling_level = "token"
    w_{i,t} = exp(sum_t m_{i,t} l_{i,t} / sum_t m_{i,t})    importance_sampling_level = "sequence" (GSPO)
    L_{i,t} = -rho_{i,t} * min(min(w, delta) * A_i, clip(w, 1 - eps_low, 1 + eps_high) * A_i) + beta * k3_{i,t}

rho is the train/inference mismatch weight (grpokit.algorithms.mismatch; 1 unless another program sampled), a
constant applied to the surrogate before beta * k3 is added, as TRL does: the KL penalty is not reweighted.

`delta` (optional) caps the unclipped branch from above (two-sided clipping, INTELLECT-2); eps_high > eps_low is
DAPO's clip-higher. When the batch is fresh (num_iterations = 1, no reuse), pi_old is pi_theta detached, so
w = 1 in value and grad w = grad log pi_theta: the surrogate's gradient is exactly A * grad log pi, while its value
is -A, which averages to ~0 over a group. That is why the logged loss is ~ beta * KL.

Aggregation over the masked tokens (m) of one optimizer step's accumulated batch, split into M micro-batches of
b completions each (T_max = max_completion_length, `token_normalizer` = tokens of the whole accumulated batch on
all processes / number of processes, supplied by the trainer):

    grpo:    (1/M) * mean_i( sum_t m L / sum_t m )       each sequence weighs the same (DeepSeekMath)
    bnpo:    (1/M) * sum m L / sum m                     token mean within each micro-batch
    dr_grpo: (1/M) * sum m L / (b * T_max)               constant normaliser (Dr. GRPO: no length bias)
    dapo:    sum m L / token_normalizer                  token mean over the whole accumulated batch (DAPO)

Summing the micro-batch losses gives the step's loss. grpo, dr_grpo and dapo give the same gradient however
the batch is split into micro-batches (equal-sized ones); bnpo does not, because each micro-batch's token mean
weighs the same whatever its token count. Across processes, DDP averages gradients, which keeps the same
property for grpo, dr_grpo and dapo (the trainer divides dapo's global token count by the number of processes).
"""

from __future__ import annotations

from typing import Callable

import torch

from grpokit.algorithms.kl import kl_k3
from grpokit.algorithms.logprobs import masked_mean


def _agg_grpo(per_token, mask, num_micro_batches, token_normalizer, max_completion_length):
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_sequence.mean() / num_micro_batches


def _agg_bnpo(per_token, mask, num_micro_batches, token_normalizer, max_completion_length):
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / num_micro_batches


def _agg_dr_grpo(per_token, mask, num_micro_batches, token_normalizer, max_completion_length):
    return (per_token * mask).sum() / (per_token.shape[0] * max_completion_length) / num_micro_batches


def _agg_dapo(per_token, mask, num_micro_batches, token_normalizer, max_completion_length):
    if token_normalizer is None:
        token_normalizer = mask.sum().clamp(min=1.0) * num_micro_batches
    return (per_token * mask).sum() / token_normalizer


LOSS_AGGREGATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": _agg_grpo,
    "bnpo": _agg_bnpo,
    "dr_grpo": _agg_dr_grpo,
    "dapo": _agg_dapo,
}


def _token_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return log_ratio  # (B, T)


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO: mean log-ratio over each completion's tokens, (B, T) -> (B, 1)."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


IMPORTANCE_SAMPLING_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token": _token_log_ratio,
    "sequence": _sequence_log_ratio,
}


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logp: torch.Tensor | None = None,
    *,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    loss_type: str = "dapo",
    max_completion_length: int = 1,
    num_micro_batches: int = 1,
    token_normalizer: float | torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of one micro-batch and its metrics (tensors; `.item()` is the logger's job).

    Args:
        logp: (B, T) log pi_theta of the completion tokens, with gradient.
        old_logp: (B, T) log pi_old, or None when the batch is fresh (then pi_old = logp.detach()).
        advantages: (B,) one advantage per completion.
        mask: (B, T) 1 for completion tokens that count, 0 for padding / after EOS / masked truncations.
        ref_logp: (B, T) log pi_ref; required when beta != 0.
        beta, epsilon_low, epsilon_high, delta: see the module docstring.
        importance_sampling_level: a key of IMPORTANCE_SAMPLING_LEVELS.
        loss_type: a key of LOSS_AGGREGATIONS.
        max_completion_length, num_micro_batches, token_normalizer: normalisers, see the module docstring.
        sampling_weights: (B, T) constant train/inference mismatch weights (algorithms.mismatch) that multiply
            the clipped surrogate of each token, before the KL term is added (as TRL does); None: all 1.
    Returns:
        loss (), and metrics: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (fractions of
        masked tokens), ratio_mean (mean importance weight), kl (mean k3, only when beta != 0).
    """
    mask = mask.to(logp.dtype)
    old = logp.detach() if old_logp is None else old_logp
    log_weight = IMPORTANCE_SAMPLING_LEVELS[importance_sampling_level](logp - old, mask)  # (B, T) or (B, 1)
    weight = torch.exp(log_weight)
    clipped = torch.clamp(weight, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = torch.clamp(weight, max=delta) if delta is not None else weight
    adv = advantages.to(logp.dtype).unsqueeze(-1)  # (B, 1)
    per_token = -torch.min(unclipped * adv, clipped * adv)  # (B, T) or (B, 1)
    per_token = per_token.expand_as(logp)
    if sampling_weights is not None:
        per_token = per_token * sampling_weights.detach().to(logp.dtype)  # (B, T), before the KL term

    metrics: dict[str, torch.Tensor] = {}
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp (log-probs of the reference model)")
        kl = kl_k3(logp, ref_logp)
        per_token = per_token + beta * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)

    loss = LOSS_AGGREGATIONS[loss_type](per_token, mask, num_micro_batches, token_normalizer, max_completion_length)

    with torch.no_grad():
        weight_t = weight.expand_as(logp)
        low = (weight_t < 1.0 - epsilon_low) & (adv < 0)
        high = (weight_t > 1.0 + epsilon_high) & (adv > 0)
        metrics["clip_ratio/low_mean"] = masked_mean(low.to(logp.dtype), mask)
        metrics["clip_ratio/high_mean"] = masked_mean(high.to(logp.dtype), mask)
        metrics["clip_ratio/region_mean"] = masked_mean((low | high).to(logp.dtype), mask)
        metrics["ratio_mean"] = masked_mean(weight_t, mask)
    return loss, metrics

"""The GRPO policy loss of one micro-batch: a policy objective per token, masks, a KL term, an aggregation.

Per token t of completion i, with advantage A (one per completion, or one per token with step rewards),
log-ratio l_t = log pi_theta - log pi_old and the importance weight w at `importance_sampling_level`:

    token:           w_t = exp(l_t)
    sequence:        w   = exp(sum_t m_t l_t / sum_t m_t)                         (GSPO)
    sequence_token:  w_t = exp(sg[sum_t m_t l_t / sum_t m_t] + log pi_theta_t - sg[log pi_theta_t])   (GSPO-token:
                     the value of GSPO's sequence ratio, the gradient of a per-token ratio)

the loss per token is

    L_t = keep_t * rho_t * P_t  +  beta * c_t * k_t          (beta * k_t only when kl is in the loss)

P_t: the policy objective (POLICY_OBJECTIVES; formulas with each function below);
rho_t: the train/inference mismatch weight (grpokit.algorithms.mismatch; 1 unless another program sampled);
keep_t: 1, or 0 for tokens dropped by the off-policy sequence mask (DeepSeek-V3.2: a sequence with A < 0 whose
    mean sampler-to-policy log-ratio exceeds off_policy_mask_threshold) or by top_entropy_quantile (only tokens
    whose entropy is at least the threshold train, "Beyond the 80/20 rule");
k_t: the KL estimator (KL_ESTIMATORS) of KL(pi_theta || pi_ref); c_t = w_t with use_bias_correction_kl (the
    importance weight, with its gradient: the KL gradient then estimates the on-policy reverse-KL gradient, as
    DeepSeek-V3.2 and TRL), else 1.

The aggregation (LOSS_AGGREGATIONS) turns (B, T) per-token losses into one number, and an entropy bonus
-entropy_coef * mean_t H_t / M (the mean over the same tokens as the policy term) is added (TRL's definition: its
size does not depend on the aggregation). With M micro-batches of b completions per optimizer step,
T_max = max_completion_length and `token_normalizer` = masked tokens of the whole accumulated batch on all
processes / number of processes (given by the trainer):

    grpo:          (1/M) * mean_i( sum_t m L / sum_t m )       each sequence weighs the same (DeepSeekMath)
    bnpo:          (1/M) * sum m L / sum m                     token mean within each micro-batch
    dr_grpo:       (1/M) * sum m L / (b * T_max)               constant normaliser (Dr. GRPO: no length bias)
    dapo:          sum m L / token_normalizer                  token mean over the whole accumulated batch (DAPO)
    sequence_sum:  (1/M) * mean_i( sum_t m L )                 each sequence's loss times its length (LUSPO)

Summing the micro-batch losses gives the step's loss. grpo, dr_grpo, dapo and sequence_sum give the same gradient
however the batch is split into equal-sized micro-batches; bnpo does not (each micro-batch's token mean weighs the
same whatever its token count). DDP averages gradients across processes, which keeps that property (the trainer
divides dapo's global token count by the number of processes).

When the batch is fresh (num_iterations = 1, no reuse) pi_old is pi_theta detached, so w = 1 in value and
grad w = grad log pi_theta: the clipped objective's gradient is A * grad log pi while its value is -A, which
averages to ~0 over a group. That is why the logged loss is ~ beta * KL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from grpokit.algorithms.kl import KL_ESTIMATORS
from grpokit.algorithms.logprobs import masked_mean
from grpokit.registry import Registry

Tensor = torch.Tensor


@dataclass(frozen=True)
class LossBatch:
    """The tensors of one micro-batch of B completions and T positions.

    logp: (B, T) log pi_theta of the completion tokens, with gradient.
    advantages: (B,) one per completion, or (B, T) one per token (step rewards).
    mask: (B, T) 1 for tokens that count, 0 for padding / after EOS / masked truncations.
    old_logp: (B, T) log pi_old; None when the batch is fresh (then pi_old = logp.detach()).
    ref_logp: (B, T) log pi_ref; needed when beta != 0 and the KL is in the loss.
    sampling_logp: (B, T) log-probs of the program that sampled (another engine); the off-policy mask reads it.
    sampling_weights: (B, T) constant mismatch weights (algorithms.mismatch); None: all 1.
    entropy: (B, T) entropy of pi_theta at each position; with gradient when entropy_coef != 0.
    entropy_threshold: tokens with entropy below it leave the policy term (top_entropy_quantile); None: all stay.
    num_micro_batches: M, micro-batches in this optimizer step.
    token_normalizer: the dapo normaliser (see the module docstring); None: this micro-batch's tokens x M.
    token_weights: (B, T) c_t, the aggregation as per-token coefficients: loss = sum_t c_t L_t in place of the
        aggregation (`aggregation_weights`; token-budgeted forwards, which hold parts of several micro-batches).
    bonus_weights: (B, T) e_t with token_weights: the entropy bonus is -entropy_coef * sum_t e_t H_t.
    """

    logp: Tensor
    advantages: Tensor
    mask: Tensor
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    sampling_logp: Tensor | None = None
    sampling_weights: Tensor | None = None
    entropy: Tensor | None = None
    entropy_threshold: float | Tensor | None = None
    num_micro_batches: int = 1
    token_normalizer: float | Tensor | None = None
    token_weights: Tensor | None = None
    bonus_weights: Tensor | None = None


@dataclass(frozen=True)
class LossSettings:
    """The numbers and names that pick the loss; every field is the GRPOConfig option of the same name.

    sampling_weights_per_sequence: the mismatch weights hold one value per sequence (a sequence_* correction mode),
    broadcast over its tokens. `extra` carries settings of user-registered objectives (GRPOConfig.loss_kwargs).
    """

    policy_objective: str = "clip"
    loss_aggregation: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    kl_estimator: str = "k3"
    use_bias_correction_kl: bool = False
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    max_completion_length: int = 1
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    sampling_weights_per_sequence: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Ratios:
    """What objectives share: log_ratio (B, T) = log pi_theta - log pi_old per token; weight (B, T) or (B, 1) =
    the importance weight w at the chosen level; advantages (B, 1) or (B, T)."""

    log_ratio: Tensor
    weight: Tensor
    advantages: Tensor


@dataclass(frozen=True)
class PolicyObjective:
    """A registered objective: fn(ratios, batch, settings) -> (B, T) or (B, 1) per-token loss P.

    aggregation: the loss_aggregation used when `loss_type` names this objective (its paper's).
    uses_level: False when the objective builds its own sequence ratio, so importance_sampling_level must stay
        "token"; a tuple of levels when only those make sense.
    applies_sampling_weights: True when fn already folds the mismatch weights in (VESPO); the loss then does not
        multiply them again.
    per_token: True when, at importance_sampling_level "token", P_t depends on token t's log-prob alone (and on
        constants): then the loss's gradient at a token is known as soon as its log-prob is, and the fused head
        computes it in its forward pass (`token_separable`; 3 head matmuls per trained token instead of 4).
    per_sample: True when a completion's P depends on that completion's tokens alone (never on the other
        completions of its micro-batch): then token budgets may regroup completions into forwards without changing
        the loss, and the automatic token budget (GRPOConfig.token_budget unset) applies.
    """

    fn: Callable[[Ratios, LossBatch, LossSettings], Tensor]
    name: str
    aggregation: str = "dapo"
    uses_level: bool | tuple[str, ...] = True
    applies_sampling_weights: bool = False
    per_token: bool = False
    per_sample: bool = False

    def __call__(self, ratios: Ratios, batch: LossBatch, settings: LossSettings) -> Tensor:
        return self.fn(ratios, batch, settings)


POLICY_OBJECTIVES = Registry("policy_objective", PolicyObjective)
LOSS_AGGREGATIONS = Registry("loss_aggregation")
IMPORTANCE_SAMPLING_LEVELS = Registry("importance_sampling_level")


# --------------------------------------------------------------------------- importance-sampling levels
@IMPORTANCE_SAMPLING_LEVELS.register("token")
def _token_level(log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    return log_ratio  # (B, T)


def _mean_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """(B, T) -> (B, 1): mean log-ratio over each completion's counted tokens."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)


@IMPORTANCE_SAMPLING_LEVELS.register("sequence")
def _sequence_level(log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO (Zheng et al. 2025): one log-weight per sequence, (B, 1)."""
    return _mean_log_ratio(log_ratio, mask)


@IMPORTANCE_SAMPLING_LEVELS.register("sequence_token")
def _sequence_token_level(log_ratio: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token: sg[GSPO log-weight] + log pi_theta - sg[log pi_theta], (B, T)."""
    return _mean_log_ratio(log_ratio, mask).detach() + logp - logp.detach()


# --------------------------------------------------------------------------- policy objectives
@POLICY_OBJECTIVES.register("clip", aggregation="dapo", per_token=True, per_sample=True)
def clip_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """PPO-clip (GRPO, DAPO's clip-higher, INTELLECT-2's two-sided cap delta):
    P = -min(min(w, delta) * A, clip(w, 1 - eps_low, 1 + eps_high) * A)."""
    w, adv = ratios.weight, ratios.advantages
    clipped = torch.clamp(w, 1.0 - s.epsilon_low, 1.0 + s.epsilon_high)
    unclipped = torch.clamp(w, max=s.delta) if s.delta is not None else w
    return -torch.min(unclipped * adv, clipped * adv)


@POLICY_OBJECTIVES.register("luspo", aggregation="sequence_sum", per_token=True, per_sample=True)
def luspo_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """LUSPO (length-unbiased sequence policy optimisation): GSPO's clipped objective, with each sequence's loss
    scaled by its length, which is its aggregation, sequence_sum. Meant for importance_sampling_level "sequence"
    (TRL accepts any level; so does grpokit)."""
    return clip_objective(ratios, batch, s)


@POLICY_OBJECTIVES.register("cispo", aggregation="dapo", per_token=True, per_sample=True)
def cispo_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """CISPO (MiniMax-M1): the weight is clipped and its gradient stopped, the log-prob carries the gradient:
    P = -sg[min(w, epsilon_high)] * A * log pi_theta. epsilon_high is the largest weight itself here (ScaleRL
    recommends 5.0), as in TRL."""
    return -torch.clamp(ratios.weight, max=s.epsilon_high).detach() * ratios.advantages * batch.logp


def _by_sign(condition: Tensor, if_true: float, if_false: float, dtype: torch.dtype) -> Tensor:
    """where(condition, if_true, if_false) in `dtype` (python floats would make a float32 tensor)."""
    high = torch.tensor(if_true, dtype=dtype, device=condition.device)
    return torch.where(condition, high, torch.tensor(if_false, dtype=dtype, device=condition.device))


@POLICY_OBJECTIVES.register("sapo", aggregation="grpo", per_token=True, per_sample=True)
def sapo_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """SAPO (Soft Adaptive Policy Optimization): a smooth gate instead of the hard clip,
    P = -(4 / tau) * sigmoid(tau * (w - 1)) * A, tau = sapo_temperature_pos if A > 0 else sapo_temperature_neg.
    At w = 1 the gradient is A * grad log pi, as the clipped objective's."""
    adv = ratios.advantages
    tau = _by_sign(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg, ratios.weight.dtype)
    return -(4.0 / tau) * torch.sigmoid(tau * (ratios.weight - 1.0)) * adv


def vespo_weights(log_ratio: Tensor, mask: Tensor, advantages: Tensor, s: LossSettings,
                  sampling_weights: Tensor | None = None) -> Tensor:
    """VESPO's gamma weight of each sequence, a constant: phi(W) = exp(lam + k log W - lam W), phi(1) = 1, with
    log W = sum_t m l_t + log rho, l_t clamped to [-20, 20] and log W to [log 1e-8, 20]; log rho (mismatch
    weights, each log clamped to [log 1e-8, 20]) is the sum over counted tokens of log rho_t, or the sequence's
    one log rho when the weights are per sequence; (k, lam) = (vespo_k_pos, vespo_lambda_pos) where A >= 0, else
    the _neg pair. Shapes: (B, T) inputs, advantages (B, 1) or (B, T) -> (B, 1) or (B, T)."""
    with torch.no_grad():
        lowest = math.log(1e-8)
        log_w = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)
        if sampling_weights is not None:
            log_rho = (sampling_weights.log().clamp(lowest, 20.0) * mask).sum(-1, keepdim=True)
            if s.sampling_weights_per_sequence:
                log_rho = log_rho / mask.sum(-1, keepdim=True).clamp(min=1.0)
            log_w = log_w + log_rho
        log_w = log_w.clamp(lowest, 20.0)
        positive = advantages >= 0
        k = _by_sign(positive, s.vespo_k_pos, s.vespo_k_neg, log_w.dtype)
        lam = _by_sign(positive, s.vespo_lambda_pos, s.vespo_lambda_neg, log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * log_w.exp())
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@POLICY_OBJECTIVES.register("vespo", aggregation="dapo", uses_level=False, applies_sampling_weights=True,
                             per_sample=True)
def vespo_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """VESPO (variational sequence-level soft policy optimisation): P = -phi(W) * A * log pi_theta, phi from
    `vespo_weights` (a constant that folds in the mismatch weights, so they are not applied again)."""
    mask = batch.mask.to(batch.logp.dtype)
    phi = vespo_weights(ratios.log_ratio, mask, ratios.advantages, s, batch.sampling_weights)
    return -phi * ratios.advantages * batch.logp


@POLICY_OBJECTIVES.register("gmpo", aggregation="grpo", uses_level=False, per_sample=True)
def gmpo_objective(ratios: Ratios, batch: LossBatch, s: LossSettings) -> Tensor:
    """GMPO (Geometric-Mean Policy Optimization, Zhao et al. 2025): the geometric mean of token ratios, each
    clipped in log space on the side the advantage pushes, P = -A_seq * exp(mean_t sg_A[clip(l_t)]), where
    sg_A[clip(l)] = sign(A) * min(sign(A) l, sign(A) clip(l, -epsilon, epsilon_high)) and A_seq = mean_t A_t.
    epsilon and epsilon_high bound the log-ratio here (the paper uses 0.4). (B, 1) per sequence."""
    mask = batch.mask.to(batch.logp.dtype)
    adv = ratios.advantages.expand_as(ratios.log_ratio)
    sign = torch.sign(adv)
    log_ratio = ratios.log_ratio.clamp(-20.0, 20.0)
    clipped = torch.clamp(log_ratio, -s.epsilon_low, s.epsilon_high)
    kept = sign * torch.min(sign * log_ratio, sign * clipped)  # (B, T)
    seq_ratio = torch.exp(_mean_log_ratio(kept, mask))  # (B, 1)
    seq_adv = _mean_log_ratio(adv, mask)  # mean advantage over the sequence's tokens
    return -seq_adv * seq_ratio


# --------------------------------------------------------------------------- aggregations
def aggregation_weights(mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    """(B, T) c with aggregation(L) = sum_t c_t L_t for every (B, T) L: the aggregation of one micro-batch as
    per-token coefficients, so that a forward holding parts of several micro-batches adds up to the same loss
    (LossBatch.token_weights). `batch` gives what the aggregation reads besides the losses (mask, counts,
    normalisers). Raises ValueError for an aggregation that is not linear in the per-token losses."""
    aggregate = LOSS_AGGREGATIONS[s.loss_aggregation]
    probe = torch.zeros(mask.shape, dtype=torch.float64, requires_grad=True)
    mask64 = mask.to(torch.float64)
    with torch.enable_grad():
        (weights,) = torch.autograd.grad(aggregate(probe, mask64, batch, s), probe, allow_unused=True)
    weights = torch.zeros_like(probe) if weights is None else weights.detach()
    check = torch.rand(mask.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    value = aggregate(check, mask64, batch, s)
    if not torch.allclose(value, (weights * check).sum(), rtol=1e-9, atol=1e-12):
        raise ValueError(f"loss aggregation {s.loss_aggregation!r} is not linear in the per-token losses, so it "
                         "cannot be split across token-budgeted forwards; set token_budget=0.")
    return weights.float()



@LOSS_AGGREGATIONS.register("grpo")
def _agg_grpo(per_token: Tensor, mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_sequence.mean() / batch.num_micro_batches


@LOSS_AGGREGATIONS.register("bnpo")
def _agg_bnpo(per_token: Tensor, mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / batch.num_micro_batches


@LOSS_AGGREGATIONS.register("dr_grpo")
def _agg_dr_grpo(per_token: Tensor, mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    return (per_token * mask).sum() / (per_token.shape[0] * s.max_completion_length) / batch.num_micro_batches


@LOSS_AGGREGATIONS.register("dapo")
def _agg_dapo(per_token: Tensor, mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    normalizer = batch.token_normalizer
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1.0) * batch.num_micro_batches
    return (per_token * mask).sum() / normalizer


@LOSS_AGGREGATIONS.register("sequence_sum")
def _agg_sequence_sum(per_token: Tensor, mask: Tensor, batch: LossBatch, s: LossSettings) -> Tensor:
    return (per_token * mask).sum(-1).mean() / batch.num_micro_batches


# --------------------------------------------------------------------------- masks
def off_policy_mask(advantages: Tensor, logp: Tensor, behaviour_logp: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, a constant: 0 for a sequence with A < 0 whose mean
    log pi_behaviour - log pi_theta over its tokens exceeds `threshold`, else 1. NaN log-probs count as 0.
    Shapes: advantages (B, 1) or (B, T); the rest (B, T) -> (B, 1) or (B, T)."""
    with torch.no_grad():
        gap = torch.nan_to_num(behaviour_logp - logp, nan=0.0)
        mean_gap = _mean_log_ratio(gap, mask)  # (B, 1)
        return ((advantages >= 0) | (mean_gap <= threshold)).to(logp.dtype)


def entropy_quantile_threshold(entropies: Tensor, quantile: float) -> Tensor:
    """The entropy at the (1 - quantile) quantile of `entropies` (1-D, the counted tokens of the batch on every
    process): tokens at or above it are the top `quantile` fraction. Empty input -> +inf (no token trains)."""
    if entropies.numel() == 0:
        return torch.tensor(float("inf"))
    return torch.quantile(entropies.to(torch.promote_types(entropies.dtype, torch.float32)), 1.0 - quantile)


# --------------------------------------------------------------------------- the loss
def _policy_terms(batch: LossBatch, s: LossSettings) -> tuple[Tensor, Ratios]:
    """Per-token policy loss with every mask and weight applied, (B, T), and the ratios it used."""
    objective: PolicyObjective = POLICY_OBJECTIVES[s.policy_objective]
    logp, mask = batch.logp, batch.mask.to(batch.logp.dtype)
    old = logp.detach() if batch.old_logp is None else batch.old_logp
    log_ratio = logp - old
    level = s.importance_sampling_level if objective.uses_level else "token"
    weight = torch.exp(IMPORTANCE_SAMPLING_LEVELS[level](log_ratio, logp, mask))
    adv = batch.advantages.to(logp.dtype)
    ratios = Ratios(log_ratio, weight, adv.unsqueeze(-1) if adv.dim() == 1 else adv)
    per_token = objective(ratios, batch, s)
    if not isinstance(per_token, Tensor) or per_token.dim() != 2 or per_token.shape[0] != logp.shape[0] or \
            per_token.shape[1] not in (1, logp.shape[1]):
        got = tuple(per_token.shape) if isinstance(per_token, Tensor) else type(per_token).__name__
        raise ValueError(
            f"policy objective {s.policy_objective!r} returned {got}; it must return a tensor of shape "
            f"{tuple(logp.shape)} (per token) or ({logp.shape[0]}, 1) (per sequence)."
        )
    per_token = per_token.expand_as(logp)
    if s.off_policy_mask_threshold is not None:
        behaviour = old if batch.sampling_logp is None else batch.sampling_logp
        per_token = per_token * off_policy_mask(ratios.advantages, logp, behaviour, mask, s.off_policy_mask_threshold)
    if batch.entropy_threshold is not None:
        per_token = per_token * (batch.entropy.detach() >= batch.entropy_threshold).to(logp.dtype)
    if batch.sampling_weights is not None and not objective.applies_sampling_weights:
        per_token = per_token * batch.sampling_weights.detach().to(logp.dtype)
    return per_token, ratios


def token_losses(batch: LossBatch, s: LossSettings) -> tuple[Tensor, Ratios, Tensor | None]:
    """(B, T) per-token loss before aggregation, L_t = keep_t rho_t P_t + beta c_t k_t (the module docstring),
    the ratios it used and the KL estimate k_t (None when beta = 0)."""
    per_token, ratios = _policy_terms(batch, s)
    if s.beta == 0.0:
        return per_token, ratios, None
    if batch.ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp (log-probs of the reference model) in the LossBatch")
    kl = KL_ESTIMATORS[s.kl_estimator](batch.logp, batch.ref_logp)
    corrected = kl * ratios.weight if s.use_bias_correction_kl else kl
    return per_token + s.beta * corrected, ratios, kl


def regroupable(s: LossSettings) -> bool:
    """Completions may be regrouped into forwards (token budgets) without changing the loss: the objective is
    `per_sample` (each completion's loss from its own tokens). The aggregation must be linear too: checked when
    the trainer starts (learner.linear_aggregation) and at every step (`aggregation_weights`)."""
    return POLICY_OBJECTIVES[s.policy_objective].per_sample


def token_separable(s: LossSettings) -> bool:
    """The per-token loss L_t depends on token t's log-prob and entropy alone: a per_token objective at the token
    importance-sampling level, no off-policy sequence mask (a sequence mean), and a linear aggregation (checked
    by `aggregation_weights`). Then a forward holding any tokens can compute its loss's gradient at once."""
    objective = POLICY_OBJECTIVES[s.policy_objective]
    level = s.importance_sampling_level if objective.uses_level else "token"
    return objective.per_token and level == "token" and s.off_policy_mask_threshold is None


def policy_loss(batch: LossBatch, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch and its metrics (tensors; `.item()` is the logger's job).

    Returns:
        loss (), and metrics: clip_ratio/low_mean, clip_ratio/high_mean, clip_ratio/region_mean (fractions of
        counted tokens whose weight is outside [1 - eps_low, 1 + eps_high] on the side the advantage pushes),
        ratio_mean (mean importance weight), kl (mean KL estimate, when beta != 0),
        entropy_mask_fraction (tokens kept by top_entropy_quantile), off_policy_mask_fraction (sequences kept).
    """
    s, logp = settings, batch.logp
    mask = batch.mask.to(logp.dtype)
    per_token, ratios, kl = token_losses(batch, s)
    metrics: dict[str, Tensor] = {}
    if kl is not None:
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if batch.token_weights is None:
        loss = LOSS_AGGREGATIONS[s.loss_aggregation](per_token, mask, batch, s)
    else:
        loss = (per_token * batch.token_weights.to(per_token.dtype)).sum()
    entropy_mask = mask
    if batch.entropy_threshold is not None:
        entropy_mask = mask * (batch.entropy.detach() >= batch.entropy_threshold).to(logp.dtype)
        metrics["entropy_mask_fraction"] = masked_mean(entropy_mask, mask)
    if s.entropy_coef != 0.0 and batch.bonus_weights is not None:
        bonus = s.entropy_coef * (batch.entropy * batch.bonus_weights.to(batch.entropy.dtype)).sum()
        metrics["entropy_bonus"] = bonus.detach()
        loss = loss - bonus
    elif s.entropy_coef != 0.0:
        bonus = s.entropy_coef * masked_mean(batch.entropy, entropy_mask) / batch.num_micro_batches
        metrics["entropy_bonus"] = bonus.detach()  # the term's share of this micro-batch's loss (not token-averaged)
        loss = loss - bonus
    metrics.update(_ratio_metrics(ratios, mask, s))
    if s.off_policy_mask_threshold is not None:
        behaviour = batch.old_logp if batch.sampling_logp is None else batch.sampling_logp
        behaviour = logp.detach() if behaviour is None else behaviour
        kept = off_policy_mask(ratios.advantages, logp, behaviour, mask, s.off_policy_mask_threshold)
        metrics["off_policy_mask_fraction"] = masked_mean(kept.expand_as(logp), mask)
    return loss, metrics


@torch.no_grad()
def _ratio_metrics(ratios: Ratios, mask: Tensor, s: LossSettings) -> dict[str, Tensor]:
    weight = ratios.weight.expand_as(mask)
    adv = ratios.advantages
    low = (weight < 1.0 - s.epsilon_low) & (adv < 0)
    high = (weight > 1.0 + s.epsilon_high) & (adv > 0)
    return {
        "clip_ratio/low_mean": masked_mean(low.to(mask.dtype), mask),
        "clip_ratio/high_mean": masked_mean(high.to(mask.dtype), mask),
        "clip_ratio/region_mean": masked_mean((low | high).to(mask.dtype), mask),
        "ratio_mean": masked_mean(weight, mask),
    }


def objective_aggregations() -> dict[str, str]:
    """{objective: the aggregation `loss_type` gives it when it names the objective alone}, from the registry."""
    return {name: POLICY_OBJECTIVES[name].aggregation for name in POLICY_OBJECTIVES}


def resolve_loss_type(loss_type: str, policy_objective: str | None) -> tuple[str, str]:
    """(objective, aggregation) from TRL's `loss_type` and our `policy_objective`.

    loss_type names an aggregation of LOSS_AGGREGATIONS (the objective is then `policy_objective`, default "clip")
    or an objective of POLICY_OBJECTIVES (that objective with the aggregation it was registered with, its paper's,
    as TRL; objective_aggregations() lists them).
    """
    if policy_objective is not None:
        POLICY_OBJECTIVES.resolve(policy_objective)  # ValueError listing the choices
    if loss_type in LOSS_AGGREGATIONS or (":" in loss_type and policy_objective is not None):
        LOSS_AGGREGATIONS.resolve(loss_type)
        return policy_objective or "clip", loss_type
    if loss_type in POLICY_OBJECTIVES or ":" in loss_type:
        objective = POLICY_OBJECTIVES[loss_type]
        if policy_objective is not None and POLICY_OBJECTIVES[policy_objective] is not objective:
            raise ValueError(
                f"loss_type={loss_type!r} already picks the {loss_type} objective but policy_objective="
                f"{policy_objective!r} names another; set loss_type to an aggregation "
                f"({', '.join(LOSS_AGGREGATIONS.names())}) to combine them."
            )
        return loss_type, objective.aggregation
    raise ValueError(
        f"loss_type={loss_type!r} is not valid; choose an aggregation ({', '.join(LOSS_AGGREGATIONS.names())}) or a "
        f"policy objective ({', '.join(POLICY_OBJECTIVES.names())}), or an import path 'package.module:function'."
    )

"""GRPO math as pure tensor functions: no config objects, no I/O, no trainer imports.

Each choice has one registry (grpokit.registry.Registry), the only list of its names, used by config
validation, `grpo train --help`, the docs and every call site; a user adds entries from their own code:
POLICY_OBJECTIVES, LOSS_AGGREGATIONS and IMPORTANCE_SAMPLING_LEVELS (losses), ADVANTAGE_ESTIMATORS,
MULTI_OBJECTIVE_AGGREGATIONS and REWARD_SCALES (advantages), KL_ESTIMATORS (kl), IS_CORRECTION_MODES (mismatch).
"""

from grpokit.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    REWARD_SCALES,
    AdvantageEstimator,
    group_advantages,
    normalize_in_groups,
)
from grpokit.algorithms.fused_head import head_logprobs, head_token_loss
from grpokit.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_k3_plus
from grpokit.algorithms.logprobs import masked_mean, token_entropy, token_logprobs
from grpokit.algorithms.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_AGGREGATIONS,
    POLICY_OBJECTIVES,
    LossBatch,
    LossSettings,
    PolicyObjective,
    Ratios,
    aggregation_weights,
    entropy_quantile_threshold,
    objective_aggregations,
    off_policy_mask,
    policy_loss,
    regroupable,
    resolve_loss_type,
    token_losses,
    token_separable,
)
from grpokit.algorithms.mismatch import IS_CORRECTION_MODES, MismatchMode, mismatch_metrics, mismatch_weights
from grpokit.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "LossBatch",
    "LossSettings",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "MismatchMode",
    "POLICY_OBJECTIVES",
    "PolicyObjective",
    "REWARD_SCALES",
    "Ratios",
    "Registry",
    "aggregation_weights",
    "entropy_quantile_threshold",
    "group_advantages",
    "head_logprobs",
    "head_token_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_k3_plus",
    "masked_mean",
    "mismatch_metrics",
    "mismatch_weights",
    "normalize_in_groups",
    "objective_aggregations",
    "off_policy_mask",
    "policy_loss",
    "regroupable",
    "resolve_loss_type",
    "token_entropy",
    "token_logprobs",
    "token_losses",
    "token_separable",
]

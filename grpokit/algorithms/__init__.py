"""GRPO math as pure tensor functions: no config objects, no I/O, no trainer imports.

Each choice has one name -> function table, used by every call site:
MULTI_OBJECTIVE_AGGREGATIONS and REWARD_SCALES (advantages), KL_ESTIMATORS (kl),
IMPORTANCE_SAMPLING_LEVELS and LOSS_AGGREGATIONS (losses), IS_CORRECTION_MODES (mismatch).
"""

from grpokit.algorithms.advantages import (
    MULTI_OBJECTIVE_AGGREGATIONS,
    REWARD_SCALES,
    group_advantages,
    normalize_in_groups,
)
from grpokit.algorithms.fused_head import head_logprobs
from grpokit.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from grpokit.algorithms.logprobs import masked_mean, token_entropy, token_logprobs
from grpokit.algorithms.losses import IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS, policy_loss
from grpokit.algorithms.mismatch import IS_CORRECTION_MODES, mismatch_metrics, mismatch_weights

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "IS_CORRECTION_MODES",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "REWARD_SCALES",
    "group_advantages",
    "head_logprobs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_mean",
    "mismatch_metrics",
    "mismatch_weights",
    "normalize_in_groups",
    "policy_loss",
    "token_entropy",
    "token_logprobs",
]

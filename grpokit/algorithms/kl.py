"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled under pi_theta (Schulman, "Approximating KL
Divergence", 2020). With log r = log pi_ref(y) - log pi_theta(y):

    k1 = -log r                 unbiased, can be negative, high variance
    k2 = (log r)^2 / 2          biased, non-negative, low variance
    k3 = (r - 1) - log r        unbiased, non-negative, low variance (DeepSeekMath's choice, the default)
    k3+ = k3 in value, k2's gradient: k2 - sg[k2] + sg[k3]  (verl's "k3+": the gradient of k2 is
          (log pi_theta - log pi_ref) grad log pi_theta, an unbiased estimate of grad KL on-policy, while k3's
          gradient (1 - r) grad log pi_theta is not)

KL_ESTIMATORS is the registry of `kl_estimator`; an entry maps (logp, ref_logp), both (B, T), to (B, T).

Each estimator is exact in expectation only when the tokens come from pi_theta; with a reused generation batch
(num_iterations > 1) they come from pi_old, which is close to pi_theta by construction of the clipped objective.
"""

from __future__ import annotations

import torch

from grpokit.registry import Registry

KL_ESTIMATORS = Registry("kl_estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref. Shapes: (B, T) -> (B, T)."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_ref - log pi_theta)^2 / 2. Shapes: (B, T) -> (B, T)."""
    return 0.5 * (ref_logp - logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1. Shapes: (B, T) -> (B, T)."""
    log_ratio = ref_logp - logp
    return torch.exp(log_ratio) - log_ratio - 1.0


@KL_ESTIMATORS.register("k3+")
def kl_k3_plus(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3's value with k2's gradient (straight-through). Shapes: (B, T) -> (B, T)."""
    k2 = kl_k2(logp, ref_logp)
    return k2 - k2.detach() + kl_k3(logp, ref_logp).detach()

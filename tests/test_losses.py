"""The policy loss: hand-worked values per loss_type, the policy-gradient identity, clipping, micro-batch
invariance, and a per-token Python loop as the oracle."""

import math

import pytest
import torch

from grpokit.algorithms import LOSS_AGGREGATIONS, kl_k3
from helpers import call_policy_loss as policy_loss

# Two completions, three positions; the second has two real tokens.
RATIOS = torch.tensor([[1.1, 1.5, 0.7], [1.1, 0.5, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
ADV = torch.tensor([1.0, -1.0], dtype=torch.float64)
OLD = torch.zeros(2, 3, dtype=torch.float64)
LOGP = RATIOS.log()


def loss_of(loss_type, **kw):
    kw.setdefault("max_completion_length", 4)
    return policy_loss(LOGP, OLD, ADV, MASK, loss_type=loss_type, **kw)


# per-token losses: row 0 (A = 1): -min(r, clip r) = [-1.1, -1.2, -0.7]; row 1 (A = -1): max(r, clip r) = [1.1, 0.8]
@pytest.mark.parametrize(
    "loss_type, expected",
    [("grpo", (-3.0 / 3 + 1.9 / 2) / 2), ("bnpo", -1.1 / 5), ("dr_grpo", -1.1 / (2 * 4)), ("dapo", -1.1 / 5)],
)
def test_loss_types_hand_worked(loss_type, expected):
    loss, _ = loss_of(loss_type)
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_dapo_uses_the_global_token_count():
    loss, _ = loss_of("dapo", token_normalizer=10.0)
    assert loss.item() == pytest.approx(-1.1 / 10, abs=1e-6)


def test_micro_batch_count_divides_the_other_loss_types():
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        one, _ = loss_of(loss_type)
        quarter, _ = loss_of(loss_type, num_micro_batches=4)
        assert quarter.item() == pytest.approx(one.item() / 4, abs=1e-9)


def test_clip_metrics_hand_worked():
    _, m = loss_of("bnpo")
    # low: r < 0.8 with A < 0 -> (1, 1); high: r > 1.2 with A > 0 -> (0, 1); five real tokens
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 5)
    assert m["clip_ratio/region_mean"].item() == pytest.approx(2 / 5)
    assert m["ratio_mean"].item() == pytest.approx(4.9 / 5)
    assert "kl" not in m


def test_clip_higher_widens_the_upper_bound():
    loss, m = loss_of("bnpo", epsilon_high=0.6)
    # row 0 t1 is no longer clipped: -1.5 instead of -1.2
    assert loss.item() == pytest.approx((-1.1 - 1.5 - 0.7 + 1.1 + 0.8) / 5, abs=1e-6)
    assert m["clip_ratio/high_mean"].item() == 0.0


def test_delta_caps_the_unclipped_branch_for_negative_advantages():
    logp = torch.tensor([[math.log(2.0)]], dtype=torch.float64)
    old = torch.zeros(1, 1, dtype=torch.float64)
    adv = torch.tensor([-1.0], dtype=torch.float64)
    mask = torch.ones(1, 1)
    plain, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo")
    capped, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo", delta=1.5)
    assert plain.item() == pytest.approx(2.0, abs=1e-6)  # max(2.0, 1.2)
    assert capped.item() == pytest.approx(1.5, abs=1e-6)  # max(min(2.0, 1.5), 1.2)


def test_sequence_level_ratio_is_exp_of_mean_log_ratio():
    loss, m = loss_of("grpo", importance_sampling_level="sequence")
    w0 = (1.1 * 1.5 * 0.7) ** (1 / 3)  # within [0.8, 1.2]: unclipped, A = 1 -> -w0
    w1 = (1.1 * 0.5) ** (1 / 2)  # 0.742 < 0.8 with A = -1 -> clipped at 0.8
    assert loss.item() == pytest.approx((-w0 + 0.8) / 2, abs=1e-6)
    assert m["ratio_mean"].item() == pytest.approx((3 * w0 + 2 * w1) / 5, abs=1e-6)


def test_kl_term_hand_worked():
    ref = LOGP - 0.1  # log(ref / p) = -0.1 everywhere
    k3 = math.exp(-0.1) + 0.1 - 1
    loss, m = loss_of("bnpo", beta=0.5, ref_logp=ref)
    assert loss.item() == pytest.approx(-1.1 / 5 + 0.5 * k3, abs=1e-6)
    assert m["kl"].item() == pytest.approx(k3, abs=1e-9)


def test_beta_without_reference_is_an_error():
    with pytest.raises(ValueError, match="ref_logp"):
        loss_of("bnpo", beta=0.1)


def test_fresh_batch_gradient_is_advantage_times_grad_logp():
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(4, 5, generator=g, dtype=torch.float64) - 2).requires_grad_()
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    loss, m = policy_loss(logp, None, adv, mask, loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -exp(logp - logp.detach()) * A = -A per token, averaged over the 11 real tokens
    assert torch.allclose(grad, -adv.unsqueeze(-1) * mask / mask.sum(), atol=1e-12)
    assert loss.item() == pytest.approx((-(adv.unsqueeze(-1) * mask).sum() / mask.sum()).item(), abs=1e-12)
    assert m["ratio_mean"].item() == 1.0

    loss, _ = policy_loss(logp, None, adv, mask, loss_type="grpo")
    (grad,) = torch.autograd.grad(loss, logp)
    lengths = mask.sum(-1, keepdim=True)
    assert torch.allclose(grad, -adv.unsqueeze(-1) * mask / (lengths * 4), atol=1e-12)


def test_fresh_batch_loss_is_beta_times_kl_when_advantages_centre():
    g = torch.Generator().manual_seed(1)
    logp = torch.randn(4, 6, generator=g, dtype=torch.float64) - 2
    ref = logp + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.float64)
    loss, m = policy_loss(logp, None, adv, mask, ref, beta=0.04, loss_type="grpo")
    assert loss.item() == pytest.approx(0.04 * m["kl"].item(), abs=1e-12)


def test_clipped_tokens_carry_no_gradient():
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=torch.float64)
    loss, _ = policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2), loss_type="bnpo")
    (grad,) = torch.autograd.grad(loss, logp)
    # token 0 is above 1 + eps with A > 0: clipped, zero gradient; token 1: -A * r / 2 tokens
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-2.0 * 1.1 / 2, abs=1e-12)


def _batch(seed=0, b=8, t=6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.1
    old = theta + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    ref = theta + 0.05 * torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 1, 4])
    mask = (torch.arange(t) < lengths.unsqueeze(-1)).double()
    return theta, old, ref, adv, mask


def _grad(loss_type, splits):
    theta, old, ref, adv, mask = _batch()
    theta.requires_grad_()
    total_tokens = mask.sum()
    grad = torch.zeros_like(theta)
    for idx in torch.arange(8).chunk(splits):
        loss, _ = policy_loss(
            theta[idx] - 1.0, old[idx] - 1.0, adv[idx], mask[idx], ref[idx] - 1.0, beta=0.1,
            loss_type=loss_type, max_completion_length=6, num_micro_batches=splits, token_normalizer=total_tokens,
        )
        grad += torch.autograd.grad(loss, theta)[0]
    return grad


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_invariant_to_micro_batch_split(loss_type):
    assert torch.allclose(_grad(loss_type, 1), _grad(loss_type, 4), atol=1e-12)


def test_bnpo_gradient_depends_on_micro_batch_split():
    assert not torch.allclose(_grad("bnpo", 1), _grad("bnpo", 4), atol=1e-6)


def _naive_loss(logp, old, ref, adv, mask, beta, eps_lo, eps_hi, loss_type, max_len):
    b, t = len(logp), len(logp[0])
    per_tok = [[0.0] * t for _ in range(b)]
    for i in range(b):
        for j in range(t):
            r = math.exp(logp[i][j] - old[i][j])
            c = min(max(r, 1 - eps_lo), 1 + eps_hi)
            kl = math.exp(ref[i][j] - logp[i][j]) - (ref[i][j] - logp[i][j]) - 1
            per_tok[i][j] = -min(r * adv[i], c * adv[i]) + beta * kl
    sums = [sum(per_tok[i][j] * mask[i][j] for j in range(t)) for i in range(b)]
    counts = [sum(mask[i]) for i in range(b)]
    if loss_type == "grpo":
        return sum(s / max(c, 1) for s, c in zip(sums, counts)) / b
    if loss_type == "dr_grpo":
        return sum(sums) / (b * max_len)
    if loss_type == "sequence_sum":
        return sum(sums) / b
    return sum(sums) / sum(counts)  # bnpo and dapo coincide on a single micro-batch


@pytest.mark.parametrize("loss_type", sorted(LOSS_AGGREGATIONS))
def test_vectorised_loss_matches_naive_loop(loss_type):
    theta, old, ref, adv, mask = _batch(seed=3)
    ours, _ = policy_loss(theta, old, adv, mask, ref, beta=0.2, epsilon_low=0.02, epsilon_high=0.05,
                          loss_type=loss_type, max_completion_length=6)
    expected = _naive_loss(theta.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                           0.2, 0.02, 0.05, loss_type, 6)
    assert ours.item() == pytest.approx(expected, abs=1e-12)
    assert kl_k3(theta, ref).min() >= 0

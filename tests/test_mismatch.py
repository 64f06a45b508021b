"""Train/inference mismatch weights (grpokit.algorithms.mismatch): hand-worked values for every mode, a naive
loop as oracle, and where the weights enter policy_loss."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import IS_CORRECTION_MODES, mismatch_metrics, mismatch_weights, policy_loss

NAN, INF = float("nan"), float("inf")


def example():
    """Two completions; row 0 has 3 tokens, row 1 has 2 (its third position is padding holding garbage).

    log-ratios l - s: row 0: +0.5, -0.25, +1.5; row 1: -2.0, +0.1.
    """
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -7.0]], dtype=torch.float64)
    sampler = torch.tensor([[-1.5, -1.75, -2.0], [-1.0, -1.1, NAN]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float64)
    return trainer, sampler, mask


def test_token_truncate_by_hand():
    weights, metrics = mismatch_weights(*example(), "token_truncate", 0.5, 3.0)
    expected = [[math.exp(0.5), math.exp(-0.25), 3.0], [0.5, math.exp(0.1), 0.0]]  # e^1.5 = 4.48 -> 3, e^-2 -> 0.5
    torch.testing.assert_close(weights.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert metrics["sampling/is_corrected_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["sampling/importance_sampling_ratio/min"].item() == pytest.approx(0.5)
    assert metrics["sampling/importance_sampling_ratio/max"].item() == pytest.approx(3.0)
    mean = (math.exp(0.5) + math.exp(-0.25) + 3.0 + 0.5 + math.exp(0.1)) / 5
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(mean, abs=1e-6)


def test_token_mask_by_hand():
    weights, metrics = mismatch_weights(*example(), "token_mask", 0.5, 3.0)
    expected = [[math.exp(0.5), math.exp(-0.25), 0.0], [0.0, math.exp(0.1), 0.0]]
    torch.testing.assert_close(weights.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-6)
    assert metrics["sampling/is_corrected_fraction"].item() == pytest.approx(2 / 5)
    assert metrics["sampling/importance_sampling_ratio/min"].item() == 0.0


def test_sequence_modes_use_the_product_of_token_ratios():
    # row 0: exp(0.5 - 0.25 + 1.5) = e^1.75 = 5.75; row 1: exp(-2.0 + 0.1) = e^-1.9 = 0.1496
    truncated, metrics = mismatch_weights(*example(), "sequence_truncate", 0.5, 3.0)
    torch.testing.assert_close(truncated.double(), torch.tensor([[3.0, 3.0, 3.0], [0.5, 0.5, 0.0]], dtype=torch.float64))
    assert metrics["sampling/is_corrected_fraction"].item() == 1.0  # both sequences (not tokens) were clipped
    masked, _ = mismatch_weights(*example(), "sequence_mask", None, 10.0)
    row1 = math.exp(-1.9)
    expected = torch.tensor([[math.exp(1.75)] * 3, [row1, row1, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(masked.double(), expected, rtol=1e-6, atol=0)
    masked, metrics = mismatch_weights(*example(), "sequence_mask", 0.2, None)
    torch.testing.assert_close(masked.double(), torch.tensor([[math.exp(1.75)] * 3, [0.0, 0.0, 0.0]], dtype=torch.float64),
                               rtol=1e-6, atol=0)
    assert metrics["sampling/importance_sampling_ratio/min"].item() == 0.0


def test_metrics_by_hand_and_padding_never_leaks():
    trainer, sampler, mask = example()
    metrics = mismatch_metrics(trainer, sampler, mask)
    gaps = [0.5, 0.25, 1.5, 2.0, 0.1]
    assert metrics["sampling/sampling_logp_difference/mean"].item() == pytest.approx(sum(gaps) / 5, abs=1e-7)
    assert metrics["sampling/sampling_logp_difference/max"].item() == pytest.approx(2.0)
    k3 = [math.exp(r) - r - 1 for r in (0.5, -0.25, 1.5, -2.0, 0.1)]
    assert metrics["sampling/kl_sampler_trainer"].item() == pytest.approx(sum(k3) / 5, abs=1e-7)
    sampler[1, 2], trainer[1, 2] = -INF, INF  # other garbage at the padding: same answers
    again = mismatch_metrics(trainer, sampler, mask)
    assert all(torch.equal(again[k], metrics[k]) for k in metrics)
    for mode in IS_CORRECTION_MODES:
        weights, _ = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        assert torch.isfinite(weights).all() and weights[1, 2] == 0


def test_empty_mask_gives_zero_weights_and_zero_metrics():
    trainer, sampler, _ = example()
    mask = torch.zeros(2, 3)
    for mode in IS_CORRECTION_MODES:
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, None, 3.0)
        assert torch.equal(weights, torch.zeros(2, 3))
        assert all(value.item() == 0.0 for value in metrics.values())


def naive_weights(trainer, sampler, mask, mode, low, high):
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    rows, cols = trainer.shape
    out = [[0.0] * cols for _ in range(rows)]
    for i in range(rows):
        logs = [float(trainer[i, t] - sampler[i, t]) if mask[i, t] else 0.0 for t in range(cols)]
        ratios = [math.exp(sum(logs))] * cols if mode.startswith("sequence") else [math.exp(x) for x in logs]
        for t in range(cols):
            r = ratios[t]
            if mode.endswith("truncate"):
                w = min(max(r, low), high)
            else:
                w = r if low <= r <= high else 0.0
            out[i][t] = w if mask[i, t] else 0.0
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("mode", sorted(IS_CORRECTION_MODES))
@pytest.mark.parametrize("bounds", [(None, 2.0), (0.5, 2.0), (0.8, None)])
def test_vectorised_equals_naive_loop(mode, bounds):
    generator = torch.Generator().manual_seed(hash((mode, bounds)) % 2**31)
    trainer = -torch.rand(6, 9, generator=generator, dtype=torch.float64) * 3
    sampler = trainer + torch.randn(6, 9, generator=generator, dtype=torch.float64) * 0.3
    mask = (torch.arange(9) < torch.randint(0, 10, (6, 1), generator=generator)).double()
    weights, _ = mismatch_weights(trainer, sampler, mask, mode, *bounds)
    torch.testing.assert_close(weights.double(), naive_weights(trainer, sampler, mask, mode, *bounds), rtol=1e-6, atol=1e-7)


def test_weights_carry_no_gradient_and_unknown_modes_are_named():
    trainer, sampler, mask = example()
    trainer.requires_grad_(True)
    weights, _ = mismatch_weights(trainer, sampler, mask, "token_truncate", None, 3.0)
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        mismatch_weights(trainer, sampler, mask, "token_clip", None, 3.0)


def test_policy_loss_scales_the_surrogate_not_the_kl():
    """With beta > 0, d loss / d logp_t = (-A * w_t + beta * (1 - exp(ref - logp))) / tokens, token by token."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.2, -1.5, -0.5]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.float64)
    advantages = torch.tensor([0.7], dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.5, 0.0]], dtype=torch.float64)
    loss, _ = policy_loss(logp, None, advantages, mask, ref, beta=0.1, loss_type="dapo", sampling_weights=weights)
    loss.backward()
    kl_grad = [0.1 * (1 - math.exp(r - lp)) for r, lp in zip((-1.2, -1.5, -0.5), (-1.0, -2.0, -0.5))]
    expected = [(-0.7 * w + k) / 3 for w, k in zip((2.0, 0.5, 0.0), kl_grad)]
    torch.testing.assert_close(logp.grad[0], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)

    ones = torch.ones(1, 3, dtype=torch.float64)
    plain_logp = logp.detach().clone().requires_grad_(True)
    weighted_logp = logp.detach().clone().requires_grad_(True)
    plain, _ = policy_loss(plain_logp, None, advantages, mask, ref, beta=0.1)
    weighted, _ = policy_loss(weighted_logp, None, advantages, mask, ref, beta=0.1, sampling_weights=ones)
    plain.backward()
    weighted.backward()
    assert torch.equal(plain, weighted) and torch.equal(plain_logp.grad, weighted_logp.grad)

"""Train/inference mismatch weights (grpokit.algorithms.mismatch): hand-worked values for every mode, padding
garbage, an all-masked row and an empty batch, a naive loop as oracle, and where the weights enter policy_loss."""

from __future__ import annotations

import math

import pytest
import torch

from grpokit.algorithms import IS_CORRECTION_MODES, mismatch_metrics, mismatch_weights
from helpers import call_policy_loss as policy_loss

NAN, INF = float("nan"), float("inf")
F64 = torch.float64
TOL = dict(rtol=0.0, atol=1e-12)  # float64
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
RATIO = "sampling/importance_sampling_ratio/"
FRACTION = "sampling/is_corrected_fraction"


def example():
    """Two completions; row 0 has 3 tokens, row 1 has 2 (its third position is padding holding NaN).

    log-ratios l - s: row 0: +0.5, -0.25, +1.5 (e^1.5 = 4.48 > C_max = 3); row 1: -2.0 (e^-2 = 0.135 < C_min = 0.5),
    +0.1. Sequence sums: row 0: 1.75 (e^1.75 = 5.75), row 1: -1.9 (e^-1.9 = 0.150).
    """
    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -7.0]], dtype=F64)
    sampler = torch.tensor([[-1.5, -1.75, -2.0], [-1.0, -1.1, NAN]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    return trainer, sampler, mask


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


def check_stats(metrics, low, mean, high, fraction):
    for key, value in (("min", low), ("mean", mean), ("max", high)):
        torch.testing.assert_close(metrics[RATIO + key], torch.tensor(value, dtype=F64), **TOL)
    torch.testing.assert_close(metrics[FRACTION], torch.tensor(fraction, dtype=F64), **TOL)


# --------------------------------------------------------------------------- hand-worked, one test per mode


def test_token_truncate_by_hand():
    weights, metrics = mismatch_weights(*example(), "token_truncate", 0.5, 3.0)
    expected = t([[math.exp(0.5), math.exp(-0.25), 3.0], [0.5, math.exp(0.1), 0.0]])  # e^1.5 -> 3, e^-2 -> 0.5
    assert weights.dtype == F64
    torch.testing.assert_close(weights, expected, **TOL)
    mean = (math.exp(0.5) + math.exp(-0.25) + 3.0 + 0.5 + math.exp(0.1)) / 5
    check_stats(metrics, 0.5, mean, 3.0, 2 / 5)  # 2 of the 5 counted tokens were truncated


def test_token_mask_by_hand():
    weights, metrics = mismatch_weights(*example(), "token_mask", 0.5, 3.0)
    expected = t([[math.exp(0.5), math.exp(-0.25), 0.0], [0.0, math.exp(0.1), 0.0]])
    torch.testing.assert_close(weights, expected, **TOL)
    check_stats(metrics, 0.0, (math.exp(0.5) + math.exp(-0.25) + math.exp(0.1)) / 5, math.exp(0.5), 2 / 5)
    # one-sided: only the upper bound
    weights, metrics = mismatch_weights(*example(), "token_mask", None, 3.0)
    expected = t([[math.exp(0.5), math.exp(-0.25), 0.0], [math.exp(-2.0), math.exp(0.1), 0.0]])
    torch.testing.assert_close(weights, expected, **TOL)
    assert metrics[FRACTION].item() == pytest.approx(1 / 5, abs=1e-12)


def test_sequence_truncate_by_hand_uses_the_sum_of_log_ratios():
    # row 0: exp(0.5 - 0.25 + 1.5) = e^1.75 = 5.75 -> 3; row 1: exp(-2.0 + 0.1) = e^-1.9 = 0.150 -> 0.5
    weights, metrics = mismatch_weights(*example(), "sequence_truncate", 0.5, 3.0)
    torch.testing.assert_close(weights, t([[3.0, 3.0, 3.0], [0.5, 0.5, 0.0]]), **TOL)
    check_stats(metrics, 0.5, (3.0 + 0.5) / 2, 3.0, 1.0)  # over completions: both truncated
    # wide bounds: the raw product of the token ratios, not exp of the mean log-ratio (e^(1.75/3) = 1.79)
    weights, metrics = mismatch_weights(*example(), "sequence_truncate", 0.1, 10.0)
    e0, e1 = math.exp(1.75), math.exp(-1.9)
    torch.testing.assert_close(weights, t([[e0, e0, e0], [e1, e1, 0.0]]), **TOL)
    check_stats(metrics, e1, (e0 + e1) / 2, e0, 0.0)


def test_sequence_mask_by_hand():
    e0, e1 = math.exp(1.75), math.exp(-1.9)
    weights, metrics = mismatch_weights(*example(), "sequence_mask", 0.5, 3.0)
    torch.testing.assert_close(weights, torch.zeros(2, 3, dtype=F64), **TOL)  # 5.75 > 3 and 0.150 < 0.5
    check_stats(metrics, 0.0, 0.0, 0.0, 1.0)
    weights, metrics = mismatch_weights(*example(), "sequence_mask", None, 10.0)
    torch.testing.assert_close(weights, t([[e0, e0, e0], [e1, e1, 0.0]]), **TOL)
    check_stats(metrics, e1, (e0 + e1) / 2, e0, 0.0)
    weights, metrics = mismatch_weights(*example(), "sequence_mask", 0.2, None)
    torch.testing.assert_close(weights, t([[e0, e0, e0], [0.0, 0.0, 0.0]]), **TOL)
    check_stats(metrics, 0.0, e0 / 2, e0, 1 / 2)  # one completion of two masked


def test_mask_bounds_are_inclusive_as_in_trl():
    trainer = t([[-1.0, -1.0]])
    sampler = t([[-1.0, -1.0 - math.log(2.0)]])  # ratios exactly 1 and 2
    weights, metrics = mismatch_weights(trainer, sampler, torch.ones(1, 2, dtype=F64), "token_mask", 1.0, 2.0)
    torch.testing.assert_close(weights, t([[1.0, 2.0]]), **TOL)
    assert metrics[FRACTION].item() == 0.0


def test_metrics_by_hand():
    trainer, sampler, mask = example()
    metrics = mismatch_metrics(trainer, sampler, mask)
    assert set(metrics) == {
        "sampling/sampling_logp_difference/mean",
        "sampling/sampling_logp_difference/max",
        "sampling/kl_sampler_trainer",
    }
    gaps = (0.5, 0.25, 1.5, 2.0, 0.1)
    k3 = [math.exp(r) - r - 1 for r in (0.5, -0.25, 1.5, -2.0, 0.1)]  # KL(sampler || trainer): r = l - s
    torch.testing.assert_close(metrics["sampling/sampling_logp_difference/mean"], torch.tensor(sum(gaps) / 5, dtype=F64), **TOL)
    torch.testing.assert_close(metrics["sampling/sampling_logp_difference/max"], torch.tensor(2.0, dtype=F64), **TOL)
    torch.testing.assert_close(metrics["sampling/kl_sampler_trainer"], torch.tensor(sum(k3) / 5, dtype=F64), **TOL)
    for mode in MODES:  # mismatch_weights reports the same three, plus the ratio statistics
        _, with_weights = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        assert set(with_weights) == set(metrics) | {RATIO + "min", RATIO + "mean", RATIO + "max", FRACTION}
        assert all(torch.equal(with_weights[k], metrics[k]) for k in metrics)


def test_k3_estimates_kl_sampler_to_trainer_from_sampler_draws():
    """Exact expectation over a 3-token vocabulary: sum_x q(x) k3(x) = KL(q || p), q the sampler."""
    q = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    p = torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    metrics = mismatch_metrics(p.log().unsqueeze(0), q.log().unsqueeze(0), torch.ones(1, 3, dtype=F64))
    kl_q_p = float((q * (q.log() - p.log())).sum())
    # the metric is the plain mean over tokens; weight each token by q to get the expectation
    k3 = [math.exp(math.log(pi) - math.log(qi)) - (math.log(pi) - math.log(qi)) - 1 for pi, qi in zip(p.tolist(), q.tolist())]
    assert sum(qi * k for qi, k in zip(q.tolist(), k3)) == pytest.approx(kl_q_p, abs=1e-12)
    assert metrics["sampling/kl_sampler_trainer"].item() == pytest.approx(sum(k3) / 3, abs=1e-12)


# --------------------------------------------------------------------------- padding, all-masked rows, empty batches


@pytest.mark.parametrize("garbage", [(NAN, NAN), (-INF, 0.0), (0.0, -INF), (INF, -INF), (1e308, -1e308)])
def test_padding_garbage_never_leaks(garbage):
    trainer, sampler, mask = example()
    clean_s = sampler.clone()
    clean_s[1, 2] = -7.0  # a harmless value at the padding
    reference = {mode: mismatch_weights(trainer, clean_s, mask, mode, 0.5, 3.0) for mode in MODES}
    sampler[1, 2], trainer[1, 2] = garbage
    for mode in MODES:
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        assert torch.isfinite(weights).all() and weights[1, 2] == 0
        assert torch.equal(weights, reference[mode][0])
        assert all(torch.isfinite(v) and torch.equal(v, reference[mode][1][k]) for k, v in metrics.items())


def test_a_counted_token_with_a_non_finite_log_prob_counts_as_padding():
    trainer, sampler, mask = example()
    sampler[0, 1] = NAN  # the sampler could not score token (0, 1)
    dropped = mask.clone()
    dropped[0, 1] = 0
    for mode in MODES:
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        expected, expected_metrics = mismatch_weights(trainer, sampler, dropped, mode, 0.5, 3.0)
        assert weights[0, 1] == 0 and torch.equal(weights, expected)
        assert all(torch.equal(metrics[k], expected_metrics[k]) for k in metrics)


def test_an_all_masked_row_gets_zero_weights_and_stays_out_of_the_metrics():
    """Row 1 has no counted token and garbage everywhere; row 0 is the example's row 0."""
    trainer = t([[-1.0, -2.0, -0.5], [INF, 0.0, NAN]])
    sampler = t([[-1.5, -1.75, -2.0], [NAN, -INF, 3.0]])
    mask = t([[1, 1, 1], [0, 0, 0]])
    e0 = math.exp(1.75)
    cases = {  # mode: (row 0 weights, min, mean, max, corrected fraction)
        "token_truncate": ([math.exp(0.5), math.exp(-0.25), 3.0], math.exp(-0.25),
                           (math.exp(0.5) + math.exp(-0.25) + 3.0) / 3, 3.0, 1 / 3),
        "token_mask": ([math.exp(0.5), math.exp(-0.25), 0.0], 0.0, (math.exp(0.5) + math.exp(-0.25)) / 3,
                       math.exp(0.5), 1 / 3),
        "sequence_truncate": ([3.0] * 3, 3.0, 3.0, 3.0, 1.0),  # over one completion, not two
        "sequence_mask": ([0.0] * 3, 0.0, 0.0, 0.0, 1.0),
    }
    for mode, (row0, low, mean, high, fraction) in cases.items():
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        torch.testing.assert_close(weights, t([row0, [0.0, 0.0, 0.0]]), **TOL)
        check_stats(metrics, low, mean, high, fraction)
    _, metrics = mismatch_weights(trainer, sampler, mask, "sequence_truncate", 0.1, 10.0)
    check_stats(metrics, e0, e0, e0, 0.0)  # the empty row's exp(0) = 1 is not in the statistics (TRL's would be)
    torch.testing.assert_close(
        mismatch_metrics(trainer, sampler, mask)["sampling/sampling_logp_difference/mean"],
        torch.tensor((0.5 + 0.25 + 1.5) / 3, dtype=F64), **TOL,
    )


@pytest.mark.parametrize("shape", [(2, 3), (0, 3)])
def test_an_empty_mask_gives_zero_weights_and_zero_metrics(shape):
    trainer, sampler, _ = example()
    trainer, sampler = trainer[: shape[0]], sampler[: shape[0]]
    mask = torch.zeros(shape)
    for mode in MODES:
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, None, 3.0)
        assert torch.equal(weights, torch.zeros(shape, dtype=F64))
        assert all(value.shape == () and value.item() == 0.0 for value in metrics.values())


# --------------------------------------------------------------------------- a naive loop as oracle


def naive(trainer, sampler, mask, mode, low, high):
    """Weights (list of rows) and metrics (dict of floats), one Python float at a time."""
    low = -math.inf if low is None else low
    high = math.inf if high is None else high
    rows, cols = trainer.shape
    weights = [[0.0] * cols for _ in range(rows)]
    gaps, k3s, units, changed = [], [], [], []
    for i in range(rows):
        logs = {}
        for j in range(cols):
            lt, st = float(trainer[i, j]), float(sampler[i, j])
            if mask[i, j] and math.isfinite(lt) and math.isfinite(st):
                logs[j] = lt - st
                gaps.append(abs(lt - st))
                k3s.append(math.exp(lt - st) - (lt - st) - 1)
        if mode.startswith("sequence"):
            ratios = {j: math.exp(sum(logs.values())) for j in logs}
        else:
            ratios = {j: math.exp(x) for j, x in logs.items()}
        row_units = []
        for j, r in ratios.items():
            w = min(max(r, low), high) if mode.endswith("truncate") else (r if low <= r <= high else 0.0)
            weights[i][j] = w
            row_units.append((w, w != r))
        units += row_units[:1] if mode.startswith("sequence") else row_units
    metrics = {
        "sampling/sampling_logp_difference/mean": sum(gaps) / len(gaps) if gaps else 0.0,
        "sampling/sampling_logp_difference/max": max(gaps, default=0.0),
        "sampling/kl_sampler_trainer": sum(k3s) / len(k3s) if k3s else 0.0,
        RATIO + "min": min((w for w, _ in units), default=0.0),
        RATIO + "mean": sum(w for w, _ in units) / len(units) if units else 0.0,
        RATIO + "max": max((w for w, _ in units), default=0.0),
        FRACTION: sum(c for _, c in units) / len(units) if units else 0.0,
    }
    return weights, metrics


def random_batch(seed: int, rows: int = 6, cols: int = 9, spread: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    trainer = -torch.rand(rows, cols, generator=generator, dtype=F64) * 3
    sampler = trainer + torch.randn(rows, cols, generator=generator, dtype=F64) * spread
    mask = (torch.arange(cols) < torch.randint(0, cols + 1, (rows, 1), generator=generator)).to(F64)
    pad = mask == 0  # garbage at every padding position
    sampler = torch.where(pad, torch.full_like(sampler, NAN), sampler)
    trainer = torch.where(pad, torch.full_like(trainer, -INF), trainer)
    return trainer, sampler, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bounds", [(None, 2.0), (0.5, 2.0), (0.8, None), (0.9, 1.1)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vectorised_equals_naive_loop(mode, bounds, seed):
    trainer, sampler, mask = random_batch(seed, spread=0.1 if mode.startswith("sequence") else 0.3)
    weights, metrics = mismatch_weights(trainer, sampler, mask, mode, *bounds)
    expected_weights, expected_metrics = naive(trainer, sampler, mask, mode, *bounds)
    torch.testing.assert_close(weights, t(expected_weights), rtol=1e-12, atol=1e-12)
    assert set(metrics) == set(expected_metrics)
    for key, value in expected_metrics.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-12, abs=1e-12), key


@pytest.mark.parametrize("mode", MODES)
def test_float32_inputs_give_float32_weights_close_to_float64(mode):
    trainer, sampler, mask = random_batch(7)
    weights64, metrics64 = mismatch_weights(trainer, sampler, mask, mode, 0.5, 2.0)
    weights32, metrics32 = mismatch_weights(trainer.float(), sampler.float(), mask.float(), mode, 0.5, 2.0)
    assert weights32.dtype == torch.float32 and all(v.dtype == torch.float32 for v in metrics32.values())
    torch.testing.assert_close(weights32.double(), weights64, rtol=1e-6, atol=1e-6)
    for key, value in metrics64.items():
        torch.testing.assert_close(metrics32[key].double(), value, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- contract


def test_weights_and_metrics_carry_no_gradient():
    trainer, sampler, mask = example()
    trainer.requires_grad_(True)
    sampler.requires_grad_(True)
    for mode in MODES:
        weights, metrics = mismatch_weights(trainer, sampler, mask, mode, 0.5, 3.0)
        assert not weights.requires_grad and weights.grad_fn is None
        assert not any(v.requires_grad for v in metrics.values())
    assert not any(v.requires_grad for v in mismatch_metrics(trainer, sampler, mask).values())


def test_the_registry_holds_exactly_the_four_trl_modes():
    assert sorted(IS_CORRECTION_MODES) == sorted(MODES)


def quarter(ratio, clip_min, clip_max):
    """A user's own mode, named by import path below: every weight 0.25."""
    return torch.full_like(ratio, 0.25)


def test_a_mode_given_as_an_import_path_weights_each_token():
    weights, metrics = mismatch_weights(*example(), "test_mismatch:quarter", 0.5, 3.0)
    torch.testing.assert_close(weights, t([[0.25, 0.25, 0.25], [0.25, 0.25, 0.0]]), **TOL)  # 0 at padding
    check_stats(metrics, 0.25, 0.25, 0.25, 1.0)
    assert IS_CORRECTION_MODES["test_mismatch:quarter"].per_sequence is False  # no decorator said otherwise
    assert "test_mismatch:quarter" not in IS_CORRECTION_MODES  # looked up, not registered: not a listed choice


def test_a_decorated_mode_keeps_per_sequence_when_named_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_modes.py").write_text(
        "from grpokit.algorithms import IS_CORRECTION_MODES\n"
        "@IS_CORRECTION_MODES.register('halved_sequence', per_sequence=True)\n"
        "def halve(ratio, clip_min, clip_max):\n"
        "    return ratio / 2\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        weights, _ = mismatch_weights(*example(), "my_modes:halve", None, None)
        by_name, _ = mismatch_weights(*example(), "halved_sequence", None, None)
    finally:
        IS_CORRECTION_MODES._entries.pop("halved_sequence")
    row0, row1 = math.exp(1.75) / 2, math.exp(-1.9) / 2  # one ratio per completion, halved
    torch.testing.assert_close(weights, t([[row0, row0, row0], [row1, row1, 0.0]]), **TOL)
    torch.testing.assert_close(by_name, weights, **TOL)


def test_the_config_takes_a_mode_by_import_path_and_names_a_bad_one():
    from grpokit.config import ConfigError, GRPOConfig

    assert GRPOConfig(vllm_importance_sampling_mode="test_mismatch:quarter").vllm_importance_sampling_mode == (
        "test_mismatch:quarter")
    with pytest.raises(ConfigError, match="^vllm_importance_sampling_mode='test_mismatch:nothing': 'test_mismatch' "
                                          "has no attribute 'nothing'; callables there: .*'quarter'"):
        GRPOConfig(vllm_importance_sampling_mode="test_mismatch:nothing")
    with pytest.raises(ConfigError, match="could not import module 'no_such_module'.*PYTHONPATH"):
        GRPOConfig(vllm_importance_sampling_mode="no_such_module:mode")
    with pytest.raises(ConfigError, match="'test_mismatch:MODES' names a tuple, not a callable; point it at a "
                                          "function constrain"):
        GRPOConfig(vllm_importance_sampling_mode="test_mismatch:MODES")


def test_an_unknown_mode_is_refused_with_the_valid_ones_named():
    with pytest.raises(ValueError, match="token_clip") as raised:
        mismatch_weights(*example(), "token_clip", None, 3.0)
    assert all(mode in str(raised.value) for mode in MODES)


# --------------------------------------------------------------------------- where the weights enter policy_loss


def test_policy_loss_scales_the_surrogate_before_the_kl_is_added():
    """beta > 0, fresh batch, dapo: d loss / d logp_t = (-A * w_t + beta * (1 - exp(ref_t - logp_t))) / 3 token by
    token. Weighting after the KL would give w_t * (-A + beta * (1 - exp(ref_t - logp_t))) / 3 instead."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    ref = t([[-1.2, -1.5, -0.4]])
    mask = torch.ones(1, 3, dtype=F64)
    advantages = t([0.7])
    w = (2.0, 0.5, 0.0)
    loss, _ = policy_loss(logp, None, advantages, mask, ref, beta=0.1, loss_type="dapo", sampling_weights=t([w]))
    loss.backward()
    kl_grad = [0.1 * (1 - math.exp(r - lp)) for r, lp in zip((-1.2, -1.5, -0.4), (-1.0, -2.0, -0.5))]
    expected = [(-0.7 * wt + k) / 3 for wt, k in zip(w, kl_grad)]
    torch.testing.assert_close(logp.grad[0], t(expected), **TOL)
    # value: surrogate -A * 1 per token (ratio 1), weighted; plus beta * k3
    k3 = [math.exp(r - lp) - (r - lp) - 1 for r, lp in zip((-1.2, -1.5, -0.4), (-1.0, -2.0, -0.5))]
    value = sum(-0.7 * wt + 0.1 * k for wt, k in zip(w, k3)) / 3
    assert loss.item() == pytest.approx(value, abs=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_policy_loss_with_unit_weights_is_unchanged(level, loss_type):
    generator = torch.Generator().manual_seed(3)
    base = -torch.rand(3, 4, generator=generator, dtype=F64)
    old = base + 0.05 * torch.randn(3, 4, generator=generator, dtype=F64)
    ref = base + 0.05 * torch.randn(3, 4, generator=generator, dtype=F64)
    mask = t([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    advantages = t([0.5, -1.0, 0.25])
    grads, losses = [], []
    for weights in (None, torch.ones(3, 4, dtype=F64)):
        logp = base.clone().requires_grad_(True)
        loss, _ = policy_loss(logp, old, advantages, mask, ref, beta=0.04, importance_sampling_level=level,
                              loss_type=loss_type, max_completion_length=4, sampling_weights=weights)
        loss.backward()
        losses.append(loss)
        grads.append(logp.grad)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])


def test_mismatch_weights_feed_policy_loss_per_token():
    """Weights from sequence_truncate (one per completion) scale each of that completion's surrogate gradients."""
    trainer, sampler, mask = example()
    weights, _ = mismatch_weights(trainer, sampler, mask, "sequence_truncate", 0.5, 3.0)  # rows: 3.0, 0.5
    logp = trainer.nan_to_num(0.0).clone().requires_grad_(True)
    advantages = t([1.0, -2.0])
    loss, _ = policy_loss(logp, None, advantages, mask, loss_type="dapo", sampling_weights=weights)
    loss.backward()
    # fresh batch, beta = 0: d loss / d logp = -A_i * w_i / (5 counted tokens) at counted tokens, 0 at padding
    expected = t([[-1.0 * 3.0 / 5] * 3, [2.0 * 0.5 / 5, 2.0 * 0.5 / 5, 0.0]])
    torch.testing.assert_close(logp.grad, expected, **TOL)

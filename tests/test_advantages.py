"""Rewards -> advantages: hand-worked values, invariances, None handling, and a naive loop as the oracle."""

import math

import pytest
import torch

from grpokit.algorithms import group_advantages

NAN = float("nan")


def adv(rows, group_size, weights=None, agg="sum_then_normalize", scale="group"):
    rewards = torch.tensor(rows, dtype=torch.float64)
    if rewards.dim() == 1:
        rewards = rewards.unsqueeze(-1)
    w = torch.ones(rewards.shape[1], dtype=torch.float64) if weights is None else torch.tensor(weights, dtype=torch.float64)
    return group_advantages(rewards, w, group_size, agg, scale)


def test_group_std_hand_worked():
    # group [1, 0, 1, 1]: mean 0.75, unbiased std sqrt((3 * 0.0625 + 0.5625) / 3) = 0.5
    a, m = adv([1, 0, 1, 1], 4)
    assert torch.allclose(a, torch.tensor([0.5, -1.5, 0.5, 0.5], dtype=torch.float64), atol=1e-12)
    assert m["reward_group_std"].item() == pytest.approx(0.5, abs=1e-12)
    assert m["frac_reward_zero_std"].item() == 0.0


def test_two_groups_are_normalised_separately():
    a, _ = adv([0, 2, 10, 30], 2)
    s = 1 / math.sqrt(2)  # (x - mean) / std for two distinct values is +-1/sqrt(2)
    assert torch.allclose(a, torch.tensor([-s, s, -s, s], dtype=torch.float64), atol=1e-12)


def test_plus_minus_one_equals_one_zero():
    a1, _ = adv([1, -1, -1, 1], 4)
    a2, _ = adv([1, 0, 0, 1], 4)
    assert torch.equal(a1, a2)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_std_scaling_invariant_to_positive_affine_maps(scale):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, 1, generator=g, dtype=torch.float64)
    w = torch.ones(1, dtype=torch.float64)
    base, _ = group_advantages(rewards, w, 6, "sum_then_normalize", scale)
    for a, b in [(3.0, -7.0), (0.01, 100.0), (250.0, 0.5)]:
        moved, _ = group_advantages(a * rewards + b, w, 6, "sum_then_normalize", scale)
        assert torch.allclose(moved, base, atol=1e-9)


def test_no_scaling_ignores_constant_shift_but_keeps_scale():
    rewards = [0.0, 1.0, 3.0, 4.0]
    a, _ = adv(rewards, 4, scale="none")
    assert torch.allclose(a, torch.tensor([-2.0, -1.0, 1.0, 2.0], dtype=torch.float64))
    shifted, _ = adv([r + 5 for r in rewards], 4, scale="none")
    assert torch.allclose(shifted, a, atol=1e-12)
    doubled, _ = adv([2 * r for r in rewards], 4, scale="none")
    assert torch.allclose(doubled, 2 * a, atol=1e-12)


def test_batch_scaling_hand_worked():
    # groups [0, 2] and [0, 4]; centred: [-1, 1, -2, 2]; batch std of [0, 2, 0, 4] (unbiased) = sqrt(11/3)
    a, _ = adv([0, 2, 0, 4], 2, scale="batch")
    s = math.sqrt(11 / 3)
    assert torch.allclose(a, torch.tensor([-1 / s, 1 / s, -2 / s, 2 / s], dtype=torch.float64), atol=1e-12)


def test_flat_group_gets_zero_and_is_counted():
    a, m = adv([1, 1, 1, 1, 0, 1, 0, 1], 4)
    assert torch.equal(a[:4], torch.zeros(4, dtype=torch.float64))
    assert a[4:].abs().sum() > 0
    assert m["frac_reward_zero_std"].item() == 0.5


def test_unscored_completion_gets_zero_and_leaves_group_stats():
    a, m = adv([[2.0], [NAN], [0.0], [4.0]], 4)
    # the scored values [2, 0, 4]: mean 2, unbiased std 2
    assert torch.allclose(a, torch.tensor([0.0, 0.0, -1.0, 1.0], dtype=torch.float64), atol=1e-12)
    assert math.isnan(m["reward"][1].item())


def test_weights_in_sum_then_normalize():
    # weighted sums: [1*1 + 2*0, 1*0 + 2*1] = [1, 2] -> +-1/sqrt(2)
    a, m = adv([[1, 0], [0, 1]], 2, weights=[1.0, 2.0])
    s = 1 / math.sqrt(2)
    assert torch.allclose(a, torch.tensor([-s, s], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(m["reward"], torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_normalize_then_sum_hand_worked():
    # group 1: f0 = [0, 2] -> z = [-s, s]; f1 = [10, 30] -> z = [-s, s]; weights [1, 3] -> sums [-4s, 4s]
    # group 2: f0 = [5, 5] is flat -> [0, 0]; f1 = [1, 3] -> [-s, s]; sums [-3s, 3s]
    # batch whitening of [-4s, 4s, -3s, 3s] (s = 1/sqrt 2): mean 0, unbiased std sqrt(50 s^2 / 3) = 5 / sqrt 3
    a, _ = adv([[0, 10], [2, 30], [5, 1], [5, 3]], 2, weights=[1.0, 3.0], agg="normalize_then_sum")
    k = math.sqrt(3) / 5 / math.sqrt(2)
    assert torch.allclose(a, torch.tensor([-4 * k, 4 * k, -3 * k, 3 * k], dtype=torch.float64), atol=1e-12)


def test_normalize_then_sum_differs_from_sum_then_normalize_on_scale_mismatch():
    rows = [[0, 0], [1, 100], [0, 100], [1, 0]]
    a_sum, _ = adv(rows, 4)
    a_norm, _ = adv(rows, 4, agg="normalize_then_sum")
    # sum_then_normalize lets the large-scale function dominate; normalize_then_sum weighs both equally
    assert a_sum[1] > 0 and a_sum[2] > 0
    assert abs(a_norm[1] - (a_norm[2] + a_norm[3])) > 0.1
    assert a_norm[0].item() == pytest.approx(-a_norm[1].item(), abs=1e-12)


@pytest.mark.parametrize("agg", ["sum_then_normalize"])  # normalize_then_sum whitens over the whole batch
def test_none_for_half_the_samples_equals_applicable_functions_alone(agg):
    g = torch.Generator().manual_seed(1)
    G, B = 4, 6
    math_r = torch.randn(B * G, generator=g, dtype=torch.float64)
    code_r = torch.randn(B * G, generator=g, dtype=torch.float64)
    code_applies = torch.arange(B * G) // G % 2 == 0  # groups 0, 2, 4 are code tasks
    both = torch.stack([torch.where(code_applies, NAN, math_r), torch.where(code_applies, code_r, NAN)], -1)
    w = torch.tensor([1.0, 0.5], dtype=torch.float64)
    a, _ = group_advantages(both, w, G, agg, "group")
    a_math, _ = group_advantages(math_r.unsqueeze(-1), w[:1], G, agg, "group")
    a_code, _ = group_advantages(code_r.unsqueeze(-1), w[1:], G, agg, "group")
    assert torch.allclose(a[~code_applies], a_math[~code_applies], atol=1e-12)
    assert torch.allclose(a[code_applies], a_code[code_applies], atol=1e-12)


def test_normalize_then_sum_none_inside_a_group():
    # f1 applies to samples 0 and 1 only: z1 over those two; sample 2 keeps only f0's z
    a, _ = adv([[0, 5], [2, 9], [4, NAN]], 3, agg="normalize_then_sum")
    z0 = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64)  # [0, 2, 4]: mean 2, std 2
    s = 1 / math.sqrt(2)
    sums = z0 + torch.tensor([-s, s, 0.0], dtype=torch.float64)
    assert torch.allclose(a, (sums - sums.mean()) / sums.std(), atol=1e-12)  # then whitened over the batch


def test_per_function_metrics_use_applicable_samples_only():
    _, m = adv([[1, NAN], [3, 4], [5, NAN], [7, 8]], 2)
    assert torch.allclose(m["reward_func_mean"], torch.tensor([4.0, 6.0], dtype=torch.float64))
    assert torch.allclose(m["reward_func_std"], torch.tensor([math.sqrt(20 / 3), math.sqrt(8)], dtype=torch.float64))


def test_group_size_must_divide():
    with pytest.raises(ValueError, match="groups of 4"):
        adv([1, 2, 3], 4)


def _naive(rewards, weights, G, agg, scale):
    """One completion at a time, plain Python floats."""
    n, f = len(rewards), len(weights)
    isnan = [[math.isnan(rewards[i][k]) for k in range(f)] for i in range(n)]

    def stats(vals):
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((v - m) ** 2 for v in vals) / max(1, len(vals) - 1))
        return m, sd, len(set(vals)) < 2

    def normalise(col):  # col: list of (value or None) for all N
        out = [0.0] * n
        batch_vals = [v for v in col if v is not None]
        batch_sd = stats(batch_vals)[1] if batch_vals else 1.0
        for start in range(0, n, G):
            vals = [v for v in col[start : start + G] if v is not None]
            if not vals:
                continue
            m, sd, flat = stats(vals)
            s = {"group": sd, "batch": batch_sd, "none": 1.0}[scale]
            for i in range(start, start + G):
                if col[i] is not None and not flat:
                    out[i] = (col[i] - m) / s
        return out

    if agg == "sum_then_normalize":
        total = [
            sum(weights[k] * rewards[i][k] for k in range(f) if not isnan[i][k]) if not all(isnan[i]) else None
            for i in range(n)
        ]
        return normalise(total)
    zs = [normalise([None if isnan[i][k] else rewards[i][k] for i in range(n)]) for k in range(f)]
    sums = {i: sum(weights[k] * zs[k][i] for k in range(f) if not isnan[i][k]) for i in range(n) if not all(isnan[i])}
    return _whiten(sums, n)


def _whiten(values, n):
    """{i: v} -> [(v_i - mean) / unbiased std] over the given entries, 0 elsewhere or when all are equal."""
    out = [0.0] * n
    vals = list(values.values())
    if len(set(vals)) < 2:
        return out
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1))
    for i, v in values.items():
        out[i] = (v - m) / sd
    return out


@pytest.mark.parametrize("agg", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_vectorised_matches_naive_loop(agg, scale):
    g = torch.Generator().manual_seed(7)
    G, B, F = 4, 5, 3
    r = torch.randint(0, 4, (B * G, F), generator=g).double()
    r[torch.rand(B * G, F, generator=g) < 0.3] = NAN
    r[2] = NAN  # a completion nobody scored
    w = [1.0, -0.5, 2.0]
    a, _ = group_advantages(r, torch.tensor(w, dtype=torch.float64), G, agg, scale)
    expected = _naive(r.tolist(), w, G, agg, scale)
    assert torch.allclose(a, torch.tensor(expected, dtype=torch.float64), atol=1e-10)

"""Advantage estimators beyond GRPO: RLOO and REINFORCE++-baseline, hand-worked (1e-12), with None rewards and
several reward functions, against a naive loop; and a user estimator registered from outside grpokit."""

import math

import pytest
import torch

from grpokit.algorithms import ADVANTAGE_ESTIMATORS, group_advantages

NAN = float("nan")
F64 = torch.float64


def adv(rows, group_size, estimator, scale="group", agg="sum_then_normalize", weights=None):
    rewards = torch.tensor(rows, dtype=F64)
    rewards = rewards.unsqueeze(-1) if rewards.dim() == 1 else rewards
    w = torch.ones(rewards.shape[1], dtype=F64) if weights is None else torch.tensor(weights, dtype=F64)
    return group_advantages(rewards, w, group_size, agg, scale, estimator)[0]


def close(a, expected):
    return torch.allclose(a, torch.tensor(expected, dtype=F64), atol=1e-12)


def test_rloo_leave_one_out_hand_worked():
    # group [1, 2, 4]: each minus the mean of the other two: 1 - 3, 2 - 2.5, 4 - 1.5
    assert close(adv([1, 2, 4], 3, "rloo", scale="none"), [-2.0, -0.5, 2.5])
    # scale "group": divided by the group's unbiased std sqrt(7/3)
    s = math.sqrt(7 / 3)
    assert close(adv([1, 2, 4], 3, "rloo"), [-2.0 / s, -0.5 / s, 2.5 / s])


def test_rloo_leaves_unscored_completions_out_of_the_baseline():
    # [1, None, 4, 2]: the baseline of each scored one is the mean of the other scored ones
    assert close(adv([1, NAN, 4, 2], 4, "rloo", scale="none"), [1 - 3.0, 0.0, 4 - 1.5, 2 - 2.5])
    # one scored completion: no other to compare with -> 0; a flat group -> 0
    assert close(adv([NAN, 3, NAN, NAN, 5, 5, 5, 5], 4, "rloo", scale="none"), [0.0] * 8)


def test_rloo_is_grpo_times_n_over_n_minus_one():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 1, generator=g, dtype=F64)
    w = torch.ones(1, dtype=F64)
    for scale in ("group", "batch", "none"):
        grpo = group_advantages(rewards, w, 4, "sum_then_normalize", scale, "grpo")[0]
        rloo = group_advantages(rewards, w, 4, "sum_then_normalize", scale, "rloo")[0]
        assert torch.allclose(rloo, grpo * 4 / 3, atol=1e-12)


def test_reinforce_plus_plus_baseline_hand_worked():
    # groups [1, 3] and [2, 6]: centred [-1, 1], [-2, 2]; batch std of the centred values = sqrt(10 / 3)
    s = math.sqrt(10 / 3)
    assert close(adv([1, 3, 2, 6], 2, "reinforce_plus_plus_baseline"), [-1 / s, 1 / s, -2 / s, 2 / s])
    # a flat group stays 0 and its zeros count in the batch std: centred [-1, 1, 0, 0], std sqrt(2 / 3)
    s = math.sqrt(2 / 3)
    assert close(adv([1, 3, 5, 5], 2, "reinforce_plus_plus_baseline"), [-1 / s, 1 / s, 0.0, 0.0])
    # None: left out of the group mean and of the batch std; the unscored completion gets 0
    # groups [1, None, 3] and [0, 0, 6]: centred [-1, 2], [-2, -2, 4]; std of those five values
    centred = [-1.0, 1.0, -2.0, -2.0, 4.0]
    mean = sum(centred) / 5
    s = math.sqrt(sum((c - mean) ** 2 for c in centred) / 4)
    assert close(adv([1, NAN, 3, 0, 0, 6], 3, "reinforce_plus_plus_baseline"),
                 [-1 / s, 0.0, 1 / s, -2 / s, -2 / s, 4 / s])


def _naive(rewards, weights, g, estimator, scale, agg):
    """Python loops: the formulas of grpokit/algorithms/advantages.py."""
    n, f = len(rewards), len(rewards[0])

    def std(values):
        if len(values) < 2:
            return 0.0
        m = sum(values) / len(values)
        return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))

    def estimate(column):  # column: n values or None
        out = [0.0] * n
        batch_scored = [v for v in column if v is not None]
        centred_all = {}
        for start in range(0, n, g):
            idx = [i for i in range(start, start + g) if column[i] is not None]
            vals = [column[i] for i in idx]
            if len(vals) < 1:
                continue
            m = sum(vals) / len(vals)
            for i in idx:
                centred_all[i] = column[i] - m
            if max(vals) == min(vals):
                continue
            for i in idx:
                if estimator == "reinforce_plus_plus_baseline":
                    continue
                c = column[i] - m if estimator == "grpo" else column[i] - (sum(vals) - column[i]) / (len(vals) - 1)
                s = {"group": std(vals), "batch": std(batch_scored), "none": 1.0}[scale]
                out[i] = c / s
        if estimator == "reinforce_plus_plus_baseline":
            s = std(list(centred_all.values()))
            for i, c in centred_all.items():
                out[i] = c / s if s > 0 and c != 0 else 0.0
        return out

    if agg == "sum_then_normalize":
        total = []
        for row in rewards:
            present = [(w * r) for w, r in zip(weights, row) if not math.isnan(r)]
            total.append(sum(present) if present else None)
        return estimate(total)
    result = [0.0] * n
    for k in range(f):
        column = [None if math.isnan(row[k]) else row[k] for row in rewards]
        z = estimate(column)
        for i in range(n):
            if column[i] is not None:
                result[i] += weights[k] * z[i]
    scored = [i for i in range(n) if any(not math.isnan(r) for r in rewards[i])]
    sums = [result[i] for i in scored]
    if len(set(sums)) < 2:  # GDPO's last step: whiten the sums over the batch's scored completions
        return [0.0] * n
    m, s = sum(sums) / len(sums), std(sums)
    return [(result[i] - m) / s if i in scored else 0.0 for i in range(n)]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("agg", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_estimators_match_a_naive_loop(estimator, agg, seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (16, 2), generator=g).to(F64)  # ties make flat groups likely
    rewards[torch.rand(16, 2, generator=g) < 0.25] = NAN
    weights = [1.0, 0.5]
    scales = ["group"] if estimator == "reinforce_plus_plus_baseline" else ["group", "batch", "none"]
    for scale in scales:
        ours = group_advantages(rewards, torch.tensor(weights, dtype=F64), 4, agg, scale, estimator)[0]
        expected = _naive(rewards.tolist(), weights, 4, estimator, scale, agg)
        assert torch.allclose(ours, torch.tensor(expected, dtype=F64), atol=1e-12), (scale, ours, expected)


def test_a_user_estimator_registers_from_outside():
    @ADVANTAGE_ESTIMATORS.register("sign_only", uses_scale_rewards=False)
    def sign_only(x, mask, scale_rewards):
        mean = torch.where(mask, x, torch.zeros_like(x)).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        return torch.where(mask, torch.sign(x - mean), torch.zeros_like(x))

    try:
        assert close(adv([1, 2, 4], 3, "sign_only"), [-1.0, -1.0, 1.0])
        from grpokit.config import ConfigError, GRPOConfig

        assert GRPOConfig(advantage_estimator="sign_only").advantage_estimator == "sign_only"
        with pytest.raises(ConfigError, match="leave scale_rewards"):
            GRPOConfig(advantage_estimator="sign_only", scale_rewards="none")
    finally:
        ADVANTAGE_ESTIMATORS._entries.pop("sign_only")

"""grpokit's math equals TRL 1.16's own implementation on identical inputs (benchmarks/check_math.py does the
work; this file holds the tolerances). Losses and every parameter gradient for each loss_type, with beta > 0,
use_bias_correction_kl, top_entropy_quantile < 1, the entropy bonus, the off-policy mask and two-sided clipping;
advantages for every scale_rewards x multi_objective_aggregation with None rewards, where the one intended
difference (TRL's 1e-4 in each std it divides by) is pinned rather than tolerated."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("trl", minversion="1.16")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import check_math  # noqa: E402


@pytest.fixture(scope="module")
def loss_results():
    return {row["case"]: row for row in check_math.check_losses()}


@pytest.fixture(scope="module")
def advantage_results():
    return {(row["multi_objective_aggregation"], row["scale_rewards"]): row for row in check_math.check_advantages()}


@pytest.mark.parametrize("case", list(check_math.LOSS_CASES))
def test_loss_and_every_gradient_equal_trl(loss_results, case):
    row = loss_results[case]
    assert row["params_compared"] == 50
    # float32 sums in different orders: a few ulps of the loss and of the largest gradient entry
    assert row["loss_abs_diff"] <= 5e-6 * max(1.0, abs(row["loss_trl"])), row
    assert row["grad_max_abs_diff"] <= 1e-6 * max(1.0, row["grad_max_abs"]), row


def test_the_cases_exercise_what_they_name(loss_results):
    """Each mask or option changes the loss, so equality above is not equality of two no-ops."""
    for base, variant in [("bnpo", "bnpo, off_policy_mask_threshold 0.05"), ("grpo", "grpo, top_entropy_quantile 0.2"),
                          ("dapo", "dapo, entropy_coef 0.01"), ("grpo", "grpo, use_bias_correction_kl"),
                          ("dapo", "dapo, epsilon_high 0.28, delta 1.5"), ("grpo", "grpo, beta 0"),
                          ("vespo", "vespo, custom k and lambda"), ("sapo", "sapo, custom temperatures")]:
        assert abs(loss_results[base]["loss_trl"] - loss_results[variant]["loss_trl"]) > 1e-3, (base, variant)


@pytest.mark.parametrize("aggregation", check_math.AGGREGATIONS)
@pytest.mark.parametrize("scale", check_math.SCALES)
def test_advantages_equal_trl_up_to_its_std_epsilon(advantage_results, aggregation, scale):
    row = advantage_results[(aggregation, scale)]
    # with rewards x 1e6, TRL's epsilon is gone from every per-group std; what is left (normalize_then_sum's batch
    # step divides z-score sums of order 1) is the factor std / (std + 1e-4), applied here to grpokit's values
    assert row["max_abs_diff_rewards_x1e6_eps_pinned"] <= 1e-6, row
    if aggregation == "sum_then_normalize" and scale == "none":
        assert row["max_abs_diff"] <= 1e-6, row  # nothing is divided: identical on the rewards as they are
    else:
        assert 1e-5 < row["max_abs_diff"] < 2e-3, row  # the epsilon's effect, of the size 1e-4 / std predicts


def test_normalize_then_sum_departs_from_trl_only_where_documented(advantage_results):
    """TRL ignores scale_rewards under normalize_then_sum; grpokit applies it to each function."""
    group = advantage_results[("normalize_then_sum", "group")]
    for scale in ("batch", "none"):
        row = advantage_results[("normalize_then_sum", scale)]
        assert row["trl"] == group["trl"]
        assert max(abs(a - b) for a, b in zip(row["grpokit"], group["grpokit"])) > 0.1

"""Numbers that used to pass silently: non-finite or out-of-range float options, a near-zero temperature,
optimizer options checked only after the model loaded, rewards beyond float32, and group statistics that
overflowed for large rewards."""

import math

import pytest
import torch

from grpokit.algorithms import group_advantages
from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.checks import numeric_fields
from grpokit.rewards import RewardError, score_completions

FLOAT_OPTIONS = sorted(name for name, spec in numeric_fields().items() if spec.kind is float)


def test_the_float_options_are_found():
    assert {"learning_rate", "beta", "temperature", "max_grad_norm", "epsilon_high", "weight_decay",
            "adam_beta1", "adam_epsilon", "top_p", "repetition_penalty"} <= set(FLOAT_OPTIONS)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("name", FLOAT_OPTIONS)
def test_every_float_option_refuses_non_finite_values(name, value):
    with pytest.raises(ConfigError, match=name):
        GRPOConfig(**{name: value})


@pytest.mark.parametrize("options, message", [
    ({"temperature": 1e-8}, r"temperature=1e-08 must be a finite number in \[0.01, 100\]. Below 0.01 sampling is "
                            "greedy in effect"),
    ({"adam_beta1": 1.5}, r"adam_beta1=1.5 must be a finite number in \[0, 1\)"),
    ({"adam_beta2": 1.0}, r"adam_beta2=1.0 must be a finite number in \[0, 1\).*never moves from 0"),
    ({"adam_epsilon": 0.0}, r"adam_epsilon=0.0 must be a finite number in \(0, 1\]"),
    ({"weight_decay": -0.1}, "weight_decay=-0.1"),
    ({"reward_weights": [1.0, math.nan]}, "reward_weights=.* finite numbers"),
    ({"min_p": 1.0}, r"min_p=1.0 must be a finite number in \[0, 1\)"),
])
def test_out_of_range_values_are_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**options)


def test_the_smallest_temperature_is_accepted():
    assert GRPOConfig(temperature=0.01).temperature == 0.01


def test_optimizer_options_fail_before_any_model_loads(tmp_path, capsys):
    from grpokit.cli import main

    recipe = tmp_path / "run.yaml"
    recipe.write_text("model: /nonexistent/model\ndataset: /nonexistent/data.jsonl\nreward_funcs: [format]\n")
    # the model and the dataset do not exist: the option is what is reported, so nothing was loaded
    assert main(["train", str(recipe), "--adam_beta1", "1.5", "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "adam_beta1=1.5 must be a finite number in [0, 1)" in err and "nonexistent" not in err


def test_a_reward_beyond_float32_names_the_function_and_the_sample():
    def huge(completions, **kwargs):
        return [1.0, 1e39]

    with pytest.raises(RewardError, match=r"huge.*1e\+39 is beyond \+-1e\+30"):
        score_completions([huge], ["p", "p"], ["a", "b"], [[1], [2]], {}, None)


@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_large_rewards_give_the_advantages_of_small_ones(scale):
    small = torch.tensor([[0.0], [1.0], [3.0], [2.0], [5.0], [5.0], [1.0], [7.0]])
    expected, _ = group_advantages(small, torch.ones(1), 4)
    got, metrics = group_advantages(small * scale, torch.ones(1), 4)
    assert torch.isfinite(got).all() and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert torch.isfinite(metrics["reward_group_std"]).all()

"""Hostile numbers for every numeric option, found from GRPOConfig's declared types (no list of options here: a
new option is covered by being declared), and reward models that would score with a random head.

Each value is either refused when the config is built, by a ConfigError that names the option, or accepted
because it lies in the Range declared with the option (grpokit/config/fields.py) - and then one training step
with it runs without a raw error. Never a raw exception, a hang, or a value outside its declared range.
"""

from __future__ import annotations

import glob
import math
import signal
import types
import typing
from pathlib import Path

import datasets
import pytest
import torch

from grpokit.config import ConfigError, GRPOConfig, choices_help
from grpokit.config.checks import numeric_fields
from grpokit.models.loading import ModelError
from grpokit.rewards import RewardError
from grpokit.rewards.registry import resolve_reward_funcs
from grpokit.rewards.reward_model import RewardModelFunction
from grpokit.config.trl_compat import AT_DEFAULT_ONLY, IGNORED, trl_option_problem

HOSTILE = [10**12, 1e12, -1, 0, 1.5, math.nan, math.inf, 1e30, "x", True]


def _declared_numeric_options() -> list[str]:
    """Every option whose declared type (Annotated stripped, as HfArgumentParser reads it) includes int or float."""
    names = []
    for name, hint in typing.get_type_hints(GRPOConfig).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if int in args or float in args:
            names.append(name)
    return names


NUMERIC = _declared_numeric_options()
# TRL options accepted only at their default are declared `Any` by the forms; their numeric ones by TRL's types
AT_DEFAULT_NUMERIC = [name for name in AT_DEFAULT_ONLY if name in NUMERIC]
MATRIX = [(name, value) for name in NUMERIC for value in HOSTILE]


@pytest.fixture(autouse=True)
def no_hang():
    """A value that makes a check loop or allocate without end fails the test instead of hanging the suite."""
    def hung(*args):
        raise AssertionError("timed out: the value hung")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _in_declared_range(name: str, value) -> bool:
    """Whether `value` is valid for `name` by its declaration alone (the test's own reading of the Range)."""
    if name in AT_DEFAULT_ONLY:
        return trl_option_problem(name, value) is None
    spec = numeric_fields()[name]
    if value is None or isinstance(value, str):
        return (value is None and spec.optional) or (isinstance(value, str) and str in spec.others)
    if isinstance(value, bool) or (spec.kind is int and not isinstance(value, int)) or not math.isfinite(value):
        return False
    bounds = spec.bounds
    if bounds is None or value in bounds.also:
        return True
    above = bounds.low is None or (value > bounds.low if bounds.low_open else value >= bounds.low)
    below = bounds.high is None or (value < bounds.high if bounds.high_open else value <= bounds.high)
    return above and below


def test_every_numeric_option_is_checked_and_grpokits_own_declare_a_range():
    assert len(NUMERIC) >= 70 and {"seed", "learning_rate", "max_steps", "top_k"} <= set(NUMERIC)
    assert set(numeric_fields()) == set(NUMERIC) - set(AT_DEFAULT_ONLY)
    # TRL options grpokit ignores take any integer (their type is still checked); every other one has a Range
    unbounded = sorted(name for name, spec in numeric_fields().items() if spec.bounds is None)
    assert set(unbounded) <= set(IGNORED), [name for name in unbounded if name not in IGNORED]


@pytest.mark.parametrize("how", ["python", "yaml"])
@pytest.mark.parametrize("name, value", MATRIX, ids=[f"{n}={v!r}" for n, v in MATRIX])
def test_a_hostile_value_is_refused_naming_the_option_or_lies_in_its_range(name, value, how):
    try:
        config = GRPOConfig(**{name: value}) if how == "python" else GRPOConfig.from_dict({name: value})
    except ConfigError as exc:
        assert name in str(exc)
        return
    assert _in_declared_range(name, value), f"{name}={value!r} was accepted outside its declared range"
    stored = getattr(config, name)
    assert stored == value and isinstance(stored, float if numeric_fields().get(name, None) and
                                          numeric_fields()[name].kind is float else type(value))


def test_the_matrix_refuses_what_the_issue_found():
    """57 options x 7 values in the issue; here every numeric option x 10 values."""
    refused = {(n, repr(v)) for n, v in MATRIX if not _accepted(n, v)}
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
                 "num_generations", "per_device_eval_batch_size"):
        assert (name, "1000000000000") in refused and (name, "1000000000000.0") in refused
    for name in ("max_steps", "save_steps", "num_iterations", "top_k", "logging_steps", "seed", "eval_steps"):
        assert (name, "1.5") in refused
    for name in ("learning_rate", "weight_decay", "adam_epsilon", "temperature", "repetition_penalty", "beta",
                 "entropy_coef"):
        assert (name, "1e+30") in refused
    assert ("seed", "-1") in refused and ("generation_batch_size", "0") in refused
    takes_text = {name for name, spec in numeric_fields().items() if str in spec.others}  # pad_to_multiple_of
    assert all((n, repr(v)) in refused for n, v in MATRIX if n not in takes_text and (
        isinstance(v, (str, bool)) or (isinstance(v, float) and not math.isfinite(v))))
    assert len(refused) > 0.85 * len(MATRIX)


def _accepted(name, value) -> bool:
    try:
        GRPOConfig(**{name: value})
    except ConfigError:
        return False
    return True


def test_every_problem_is_reported_at_once_before_any_model_loads():
    with pytest.raises(ConfigError) as info:
        GRPOConfig(max_steps=1.5, seed=-1, learning_rate=1e30, top_k=1.5, generation_batch_size=0,
                   per_device_train_batch_size=10**12, loss_type="ppo")
    message = str(info.value)
    assert message.startswith("7 problems in the options:")
    for text in ("max_steps=1.5 must be -1 or an integer in [1, 1000000000]",
                 "seed=-1 must be an integer in [0, 4294967295]", "learning_rate=1e+30 must be a finite number in [0, 1]",
                 "top_k=1.5 must be an integer", "generation_batch_size=0", "per_device_train_batch_size=1000000000000",
                 "loss_type='ppo'"):
        assert text in message


def test_a_generation_batch_of_in_range_sizes_is_still_bounded():
    with pytest.raises(ConfigError, match=r"would hold 4294967296 completions per process.*the most is 1048576"):
        GRPOConfig(per_device_train_batch_size=2**16, gradient_accumulation_steps=2**16, num_generations=2)
    assert GRPOConfig(per_device_train_batch_size=1024, gradient_accumulation_steps=1024, num_generations=16)


def test_help_shows_each_range_from_its_declaration():
    assert choices_help("learning_rate") == " Range: [0, 1]."
    assert choices_help("max_steps") == " Range: -1 or [1, 1000000000]."
    assert choices_help("generation_batch_size") == " Range: [1, 1048576] or null."
    assert choices_help("seed") == " Range: [0, 4294967295]."
    assert "Choices" in choices_help("loss_type") and "Range" not in choices_help("loss_type")


def test_an_int_for_a_float_option_is_stored_as_a_float():
    config = GRPOConfig(adam_beta1=0, learning_rate=1)
    assert isinstance(config.adam_beta1, float) and isinstance(config.learning_rate, float)


@pytest.mark.parametrize("path", sorted(glob.glob(str(Path(__file__).parent.parent / "examples" / "*.yaml"))))
def test_the_example_configs_are_accepted(path):
    from grpokit.cli import build_parser, merge_train_options
    from grpokit.config import load_yaml

    cli = build_parser().parse_args(["train", path])
    cli.extra_options = {}
    merge_train_options(load_yaml(path), cli)


# ------------------------------------------------------------- accepted hostile values train one step


_BASE = dict(max_steps=1, num_generations=4, per_device_train_batch_size=8, max_completion_length=4,
             learning_rate=1e-2, disable_tqdm=True, seed=0, log_completions=False)


def _accepted_with_base() -> list[tuple[str, object]]:
    accepted = []
    for name, value in MATRIX:
        try:
            GRPOConfig(**{**_BASE, name: value, "output_dir": "unused"})
        except ConfigError:
            continue
        accepted.append((name, value))
    return accepted


ACCEPTED = _accepted_with_base()


def test_the_accepted_values_train_one_step_without_a_raw_error(tmp_path):
    """The issue found 4 raw errors after the model loaded (generation_batch_size=0, top_k=1.5, ...): every value
    the config accepts must train (here: one step of a tiny model on the CPU)."""
    from grpokit.tiny import tiny_model_and_tokenizer
    from grpokit.trainer import GRPOTrainer

    data = datasets.Dataset.from_list([{"prompt": "ab" * (i + 1)} for i in range(8)])

    def reward(completions, **kwargs):
        return [c.count("a") / max(1, len(c)) for c in completions]

    assert len(ACCEPTED) > 50
    failures = []
    for i, (name, value) in enumerate(ACCEPTED):
        args = GRPOConfig(**{**_BASE, name: value, "output_dir": str(tmp_path / str(i))})
        model, tokenizer = tiny_model_and_tokenizer(hidden_size=16, num_layers=1)
        try:
            GRPOTrainer(model, [reward], args=args, train_dataset=data, processing_class=tokenizer).train()
        except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
            failures.append(f"{name}={value!r}: {type(exc).__name__}: {exc}")
    assert not failures, failures


# ------------------------------------------------------------- reward models


def _tiny(cls, path, num_labels=1):
    from transformers import Qwen2Config

    from grpokit.tiny import char_tokenizer

    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=num_labels, pad_token_id=0)
    model = cls(config)
    if path is not None:
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model


def test_a_causal_lm_folder_given_as_a_reward_model_is_refused(tmp_path):
    from transformers import Qwen2ForCausalLM

    _tiny(Qwen2ForCausalLM, tmp_path / "lm")
    with pytest.raises(ModelError, match=r"'.*/lm' is a Qwen2ForCausalLM, a generative model.*randomly initialised"):
        RewardModelFunction(str(tmp_path / "lm"), device="cpu")
    with pytest.raises(RewardError, match=r"could not load reward model '.*/lm'.*Qwen2ForCausalLM"):
        resolve_reward_funcs([str(tmp_path / "lm")], reward_model_kwargs={"device": "cpu"})


def test_a_checkpoint_without_a_trained_score_head_is_refused_whatever_its_config_says(tmp_path):
    """The config names a sequence classifier but the weights are a causal LM's: the load info says score.weight
    would be newly initialised."""
    import json

    from transformers import Qwen2ForCausalLM

    _tiny(Qwen2ForCausalLM, tmp_path / "lm")
    config = json.loads((tmp_path / "lm" / "config.json").read_text())
    config["architectures"] = ["Qwen2ForSequenceClassification"]
    (tmp_path / "lm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"'.*/lm' has no trained weights for score.weight.*randomly initialised"):
        RewardModelFunction(str(tmp_path / "lm"), device="cpu")


def test_a_causal_lm_object_given_as_a_reward_model_is_refused():
    from transformers import Qwen2ForCausalLM

    with pytest.raises(ModelError, match="Qwen2ForCausalLM, a generative model"):
        resolve_reward_funcs([_tiny(Qwen2ForCausalLM, None)], reward_model_kwargs={"device": "cpu"})


def test_a_reward_model_folder_with_garbage_weights_names_the_path(tmp_path):
    from transformers import Qwen2ForSequenceClassification

    _tiny(Qwen2ForSequenceClassification, tmp_path / "rm")
    assert RewardModelFunction(str(tmp_path / "rm"), device="cpu")(["a"], ["b"])  # a trained head loads
    (tmp_path / "rm" / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    with pytest.raises(ModelError, match=r"The weights of reward model '.*/rm' cannot be read: SafetensorError"):
        RewardModelFunction(str(tmp_path / "rm"), device="cpu")
    with pytest.raises(RewardError, match=r"could not load reward model '.*/rm'"):
        resolve_reward_funcs([str(tmp_path / "rm")], reward_model_kwargs={"device": "cpu"})

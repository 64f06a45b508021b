"""The reward-function contract: resolving specs, calling functions, checking what they return."""

from __future__ import annotations

import asyncio
import math
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from test_rewards_builtin import reward_model_dir  # noqa: F401 - a fixture: the tiny Qwen2 reward model on disk

from grpokit.rewards import (
    BUILTIN_REWARDS,
    HTTPRewardFunction,
    RewardError,
    RewardFunction,
    RewardModelFunction,
    SoftOverlongPunishment,
    resolve_reward_funcs,
    score_completions,
)

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["alpha", "beta", "gamma"]
IDS = [[5, 6], [7], [8, 9, 10]]
COLUMNS = {"answer": ["a", "b", "c"], "difficulty": [1, 2, 3]}


def score(funcs, error_policy="raise", completions=COMPLETIONS, columns=COLUMNS, state=None):
    return score_completions(
        resolve_reward_funcs(funcs), PROMPTS, completions, IDS, columns, state, error_policy=error_policy
    )


def first_letter_is_a(completions, **kwargs):
    return [float(c.startswith("a")) for c in completions]


async def async_length(completions, **kwargs):
    await asyncio.sleep(0)
    return [len(c) for c in completions]


class Constant:
    def __init__(self, value):
        self.value = value

    def __call__(self, completions, **kwargs):
        return [self.value] * len(completions)


# --- calling convention --------------------------------------------------------------------------------------


def test_every_argument_reaches_the_function_by_name_and_by_identity():
    seen = {}
    state = object()

    def spy(prompts, completions, completion_ids, trainer_state, **columns):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, state=trainer_state, columns=columns)
        return [0.0] * len(completions)

    score([spy], state=state)
    assert seen["prompts"] is PROMPTS and seen["completions"] is COMPLETIONS and seen["ids"] is IDS
    assert seen["state"] is state
    hooks = {name: seen["columns"].pop(name) for name in ("log_extra", "log_metric")}  # no-ops outside a trainer
    assert hooks["log_extra"]("column", [1, 2]) is None and hooks["log_metric"]("name", 1.0) is None
    assert seen["columns"] == COLUMNS
    assert seen["columns"]["answer"] is COLUMNS["answer"]


def test_sync_async_and_class_functions_fill_columns_in_order():
    funcs = [first_letter_is_a, async_length, Constant(2.5)]
    assert [f.name for f in resolve_reward_funcs(funcs)] == ["first_letter_is_a", "async_length", "Constant"]
    result = score(funcs)
    assert result.rewards.dtype == torch.float32
    assert result.rewards.tolist() == [[1.0, 5.0, 2.5], [0.0, 4.0, 2.5], [0.0, 5.0, 2.5]]
    assert result.failures == [0, 0, 0]


def test_async_functions_run_concurrently_and_sync_ones_in_order():
    order = []

    async def slow_a(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0] * len(completions)

    async def slow_b(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [2.0] * len(completions)

    def first(completions, **kwargs):
        order.append("first")
        return [0.0] * len(completions)

    def second(completions, **kwargs):
        order.append("second")
        return [0.0] * len(completions)

    start = time.monotonic()
    result = score([slow_a, first, slow_b, second])
    assert time.monotonic() - start < 0.55  # two 0.3 s sleeps overlapped
    assert order == ["first", "second"]
    assert result.rewards[:, 0].tolist() == [1.0] * 3 and result.rewards[:, 2].tolist() == [2.0] * 3


def test_async_callable_object_is_detected_and_awaited():
    class AsyncReward:
        async def __call__(self, completions, **kwargs):
            return [3.0] * len(completions)

    funcs = resolve_reward_funcs([AsyncReward()])
    assert score(funcs).rewards[:, 0].tolist() == [3.0] * 3


def test_scoring_works_inside_a_running_event_loop():
    async def main():
        return score([async_length, first_letter_is_a])

    assert asyncio.run(main()).rewards[:, 0].tolist() == [5.0, 4.0, 5.0]


def test_conversational_prompts_and_completions_pass_through_unchanged():
    prompts = [[{"role": "user", "content": "hi"}]] * 3
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]

    def content_length(completions, prompts, **kwargs):
        assert prompts[0][0]["role"] == "user"
        return [len(c[0]["content"]) for c in completions]

    result = score_completions(resolve_reward_funcs([content_length]), prompts, completions, IDS, {}, None)
    assert result.rewards[:, 0].tolist() == [5.0, 4.0, 5.0]


# --- return values -------------------------------------------------------------------------------------------


def test_none_becomes_nan_and_is_not_a_failure():
    result = score([lambda completions, **k: [1.0, None, 0.0]])
    assert result.rewards[0, 0] == 1.0 and math.isnan(result.rewards[1, 0]) and result.rewards[2, 0] == 0.0
    assert result.failures == [0]


@pytest.mark.parametrize(
    "values",
    [
        [True, False, 1],
        [np.float32(0.5), np.int64(2), np.bool_(True)],
        [torch.tensor(0.25), torch.tensor(3), np.array(1.5)],
        np.array([1.0, 2.0, 3.0]),
        torch.tensor([1.0, 2.0, 3.0]),
        (1, 2, 3),
    ],
)
def test_real_number_types_are_accepted(values):
    expected = [float(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    result = score([lambda completions, **k: values])
    assert result.rewards[:, 0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("bad", [[1.0, 2.0], [1.0] * 4, 1.0, None, "abc", {"a": 1}, np.ones((3, 1))])
def test_wrong_length_or_not_a_list_is_an_error_under_both_policies(bad):
    def broken(completions, **kwargs):
        return bad

    for policy in ("raise", "none"):
        with pytest.raises(RewardError, match=r"reward function 'broken' returned .* for a batch of 3 completions"):
            score([broken], error_policy=policy)


@pytest.mark.parametrize(
    "bad, problem",
    [("1.0", "is not a real number"), (float("nan"), "not finite"), (float("inf"), "not finite"),
     (1 + 2j, "is not a real number"), (torch.tensor([1.0, 2.0]), "is not a single number"), ([1.0], "not a real")],
)
def test_invalid_value_raises_with_name_index_excerpt_and_fix(bad, problem):
    long_completion = "Z" * 500

    def picky(completions, **kwargs):
        return [0.0, bad, 1.0]

    with pytest.raises(RewardError) as info:
        score([picky], completions=["alpha", long_completion, "gamma"])
    message = str(info.value)
    assert "reward function 'picky'" in message and "sample 1" in message and problem in message
    assert "Z" * 200 in message and "Z" * 201 not in message and "300 more characters" in message
    assert "Fix: return a list with one float per completion" in message


def test_invalid_value_under_policy_none_is_nan_and_counted():
    result = score([lambda completions, **k: ["x", 2.0, float("inf")], first_letter_is_a], error_policy="none")
    column = result.rewards[:, 0]
    assert math.isnan(column[0]) and column[1] == 2.0 and math.isnan(column[2])
    assert result.failures == [2, 0]


def test_raising_function_is_reported_with_its_exception_chained():
    def divide(completions, **kwargs):
        return [1 / 0 for _ in completions]

    with pytest.raises(RewardError) as info:
        score([divide])
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    message = str(info.value)
    assert "reward function 'divide' raised ZeroDivisionError: division by zero" in message
    assert "samples 0..2" in message and "'alpha'" in message and 'error_policy="none"' in message


def test_raising_function_under_policy_none_gives_nan_for_the_call_and_others_still_score():
    async def failing_async(completions, **kwargs):
        raise RuntimeError("service down")

    def failing(completions, **kwargs):
        raise KeyError("x")

    result = score([failing, first_letter_is_a, failing_async], error_policy="none")
    assert torch.isnan(result.rewards[:, 0]).all() and torch.isnan(result.rewards[:, 2]).all()
    assert result.rewards[:, 1].tolist() == [1.0, 0.0, 0.0]
    assert result.failures == [3, 0, 3]


def test_signature_mismatch_is_reported_as_a_raise():
    def no_kwargs(completions):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="'no_kwargs' raised TypeError") as info:
        score([no_kwargs])
    assert isinstance(info.value.__cause__, TypeError)


def test_bad_error_policy_and_inconsistent_batch_are_rejected():
    funcs = resolve_reward_funcs([first_letter_is_a])
    with pytest.raises(ValueError, match="error_policy must be one of"):
        score_completions(funcs, PROMPTS, COMPLETIONS, IDS, {}, None, error_policy="ignore")
    with pytest.raises(ValueError, match=r"3 completions but \{\"column 'answer'\": 2\}"):
        score_completions(funcs, PROMPTS, COMPLETIONS, IDS, {"answer": ["a", "b"]}, None)
    with pytest.raises(ValueError, match=r"column\(s\) \['prompts'\] clash"):
        score_completions(funcs, PROMPTS, COMPLETIONS, IDS, {"prompts": PROMPTS}, None)


def test_empty_batch_gives_an_empty_matrix_without_calling():
    def never(completions, **kwargs):
        raise AssertionError("called")

    result = score_completions(resolve_reward_funcs([never]), [], [], [], {}, None)
    assert result.rewards.shape == (0, 1) and result.failures == [0]


# --- resolving specs -----------------------------------------------------------------------------------------


def test_builtin_names_dicts_and_duplicates_resolve_to_unique_names():
    funcs = resolve_reward_funcs(
        ["format", "format", {"name": "soft_overlong", "max_completion_length": 10, "cache_length": 4},
         Constant(1), Constant(2), lambda completions, **k: [0.0] * len(completions)],
        max_completion_length=32,
    )
    assert [f.name for f in funcs] == ["format", "format_2", "soft_overlong", "Constant", "Constant_2", "lambda"]
    assert all(isinstance(f, RewardFunction) for f in funcs)
    overlong = funcs[2].fn
    assert isinstance(overlong, SoftOverlongPunishment)
    assert (overlong.max_completion_length, overlong.cache_length) == (10, 4)


def test_every_builtin_name_resolves():
    funcs = resolve_reward_funcs(list(BUILTIN_REWARDS), max_completion_length=64)
    assert [f.name for f in funcs] == list(BUILTIN_REWARDS)


def test_length_builtins_take_the_trainer_limit_or_explain_how_to_give_it():
    assert resolve_reward_funcs(["soft_overlong"], max_completion_length=100)[0].fn.max_completion_length == 100
    with pytest.raises(RewardError, match="needs the generation limit.*'max_completion_length'"):
        resolve_reward_funcs(["length_penalty"])


def test_unknown_name_lists_builtins_forms_and_a_suggestion():
    with pytest.raises(RewardError) as info:
        resolve_reward_funcs(["formatt"])
    message = str(info.value)
    assert "unknown reward 'formatt'" in message and "Did you mean 'format'?" in message
    for name in BUILTIN_REWARDS:
        assert name in message
    for form in ("package.module:function", "http://", "AutoModelForSequenceClassification", "dict"):
        assert form in message


def test_bad_dict_options_and_bad_types_are_rejected_early():
    with pytest.raises(RewardError, match=r"has no option\(s\) \['max_len'\]; its options are"):
        resolve_reward_funcs([{"name": "soft_overlong", "max_len": 5}])
    with pytest.raises(RewardError, match="needs a 'name'"):
        resolve_reward_funcs([{"max_completion_length": 5}])
    with pytest.raises(RewardError, match="of type int is not accepted"):
        resolve_reward_funcs([3])
    with pytest.raises(RewardError, match="no reward functions given"):
        resolve_reward_funcs([])
    with pytest.raises(RewardError, match="could not build built-in reward 'format'.*not a valid regular expression"):
        resolve_reward_funcs([{"name": "format", "pattern": "("}])


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def shout(completions, **kwargs):
            return [float(c.isupper()) for c in completions]

        class Scaled:
            def __init__(self, factor=1.0):
                self.factor = factor
            def __call__(self, completions, **kwargs):
                return [self.factor * len(c) for c in completions]

        class holder:
            def nested(completions, **kwargs):
                return [7.0] * len(completions)

        NOT_CALLABLE = 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_import_paths_load_functions_classes_and_dotted_attributes(reward_module):
    funcs = resolve_reward_funcs(
        ["my_rewards:shout", "my_rewards:holder.nested", {"name": "my_rewards:Scaled", "factor": 2.0}]
    )
    assert [f.name for f in funcs] == ["shout", "nested", "Scaled"]
    assert score(funcs, completions=["ABC", "b", "c"]).rewards.tolist() == [[1, 7, 6], [0, 7, 2], [0, 7, 2]]


def test_import_path_errors_say_which_part_failed(reward_module):
    with pytest.raises(RewardError, match="could not import module 'no_such_mod'.*installed or on sys.path"):
        resolve_reward_funcs(["no_such_mod:f"])
    with pytest.raises(RewardError, match=r"'my_rewards' has no attribute 'shot'; callables there: \[.*'shout'"):
        resolve_reward_funcs(["my_rewards:shot"])
    with pytest.raises(RewardError, match="names a int, not a callable"):
        resolve_reward_funcs(["my_rewards:NOT_CALLABLE"])
    with pytest.raises(RewardError, match="is a function; options .* apply only to classes"):
        resolve_reward_funcs([{"name": "my_rewards:shout", "factor": 2}])


def test_url_spec_becomes_an_http_reward_named_after_the_host():
    funcs = resolve_reward_funcs(["http://rewards.example.com:8080/score", "https://rewards.example.com/v2"])
    assert isinstance(funcs[0].fn, HTTPRewardFunction) and funcs[0].fn.url == "http://rewards.example.com:8080/score"
    assert [f.name for f in funcs] == ["rewards.example.com", "rewards.example.com_2"]
    with pytest.raises(RewardError, match="must be an http:// or https:// URL with a host"):
        resolve_reward_funcs(["http://"])


def test_local_folder_becomes_a_reward_model_with_its_kwargs(reward_model_dir):
    funcs = resolve_reward_funcs([reward_model_dir], reward_model_kwargs={"batch_size": 2, "device": "cpu"})
    model = funcs[0].fn
    assert isinstance(model, RewardModelFunction) and model.batch_size == 2
    assert funcs[0].name == "tiny-rm"


def test_unloadable_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(RewardError, match="could not load reward model .*AutoModelForSequenceClassification"):
        resolve_reward_funcs([str(tmp_path)])

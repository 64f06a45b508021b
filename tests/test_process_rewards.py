"""Process supervision (step rewards): per-token advantages, step splitting, offsets -> tokens, the contract."""

from __future__ import annotations

import asyncio
import math
import os
import random
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from grpokit.algorithms.process import process_advantages
from grpokit.rewards import (
    RewardError,
    StepReward,
    offsets_to_token_indices,
    resolve_reward_funcs,
    score_completions,
    split_steps,
    token_char_ends,
)
from grpokit.rewards.steps import _incremental_ends, _prefix_ends, step_spans
from grpokit.tiny import char_tokenizer

R3 = 1 / math.sqrt(3)


def advantages(steps, group_size, num_tokens, scale="group", weight=1.0):
    return process_advantages(steps, group_size, num_tokens, scale_rewards=scale, weight=weight)


def assert_close(actual, expected):
    assert actual.dtype == torch.float32
    assert torch.allclose(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


# --- process_advantages: hand-worked values ------------------------------------------------------------------

# One group of two completions, T = 5. Completion 0: steps ending at tokens 1 (reward 3) and 3 (reward 0);
# completion 1: one step ending at token 2 (reward 0).
ONE_GROUP = [[(1, 3.0), (3, 0.0)], [(2, 0.0)]]


def test_group_scale_hand_worked():
    # pooled [3, 0, 0]: mean 1, unbiased std sqrt(((3-1)^2 + 1 + 1) / 2) = sqrt(3)
    # r~ = [2, -1, -1] / sqrt(3)
    # completion 0: t <= 1 sums both steps (2 - 1)/sqrt(3); t = 2, 3 only the second -1/sqrt(3); t = 4 none: 0
    # completion 1: t <= 2 gets -1/sqrt(3); after its only step: 0
    a, metrics = advantages(ONE_GROUP, 2, 5)
    assert a.shape == (2, 5)
    assert_close(a, [[R3, R3, -R3, -R3, 0.0], [-R3, -R3, -R3, 0.0, 0.0]])
    assert metrics["step_reward_mean"].item() == pytest.approx(1.0, abs=1e-6)  # (3 + 0 + 0) / 3
    assert metrics["steps_per_completion"].item() == pytest.approx(1.5, abs=1e-6)  # 3 steps / 2 completions


def test_scale_none_only_centres():
    # r~ = r - mean = [2, -1, -1]
    a, _ = advantages(ONE_GROUP, 2, 5, scale="none")
    assert_close(a, [[1.0, 1.0, -1.0, -1.0, 0.0], [-1.0, -1.0, -1.0, 0.0, 0.0]])


def test_batch_scale_uses_the_std_of_every_step_of_the_batch():
    # group 1: completion 2 has one step at token 0 (reward 1), completion 3 one at token 1 (reward 3).
    steps = ONE_GROUP + [[(0, 1.0)], [(1, 3.0)]]
    # batch pooled [3, 0, 0, 1, 3]: mean 1.4, squared deviations 2.56 + 1.96 + 1.96 + 0.16 + 2.56 = 9.2,
    # unbiased variance 9.2 / 4 = 2.3, s = sqrt(2.3); group means 1 and 2 are subtracted per group:
    # group 0: r~ = [2, -1, -1] / s, group 1: r~ = [-1, 1] / s
    s = math.sqrt(2.3)
    a, _ = advantages(steps, 2, 5, scale="batch")
    assert_close(a, [
        [1 / s, 1 / s, -1 / s, -1 / s, 0.0],
        [-1 / s, -1 / s, -1 / s, 0.0, 0.0],
        [-1 / s, 0.0, 0.0, 0.0, 0.0],
        [1 / s, 1 / s, 0.0, 0.0, 0.0],
    ])
    # with scale "group", group 1 is divided by its own std: [1, 3] has unbiased std sqrt(2)
    a, _ = advantages(steps, 2, 5, scale="group")
    r2 = 1 / math.sqrt(2)
    assert_close(a[2:], [[-r2, 0.0, 0.0, 0.0, 0.0], [r2, r2, 0.0, 0.0, 0.0]])
    assert_close(a[:2], [[R3, R3, -R3, -R3, 0.0], [-R3, -R3, -R3, 0.0, 0.0]])


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_flat_groups_and_single_step_groups_get_zero(scale):
    # group 0: every step reward 0.5 (flat); group 1: a single step in the whole group; group 2: no steps at all;
    # group 3 is not flat, so "batch" has a non-zero std to divide by
    steps = [[(1, 0.5)], [(2, 0.5), (3, 0.5)], [(1, 7.0)], None, [], None, [(0, 0.0)], [(0, 1.0)]]
    a, _ = advantages(steps, 2, 4, scale=scale)
    assert torch.equal(a[:6], torch.zeros(6, 4))
    assert a[6:].abs().sum() > 0


def test_none_and_empty_entries_contribute_no_steps():
    # group of 3: only completion 2 has steps, rewards [1, 0] at tokens 1 and 2: mean 0.5,
    # unbiased std sqrt((0.25 + 0.25) / 1) = sqrt(0.5), r~ = [+-0.5 / sqrt(0.5)] = [+-sqrt(0.5)]
    # completion 2: t <= 1 gets sqrt(.5) - sqrt(.5) = 0, t = 2 gets -sqrt(.5), t = 3 nothing
    a, metrics = advantages([None, [], [(1, 1.0), (2, 0.0)]], 3, 4)
    h = math.sqrt(0.5)
    assert_close(a, [[0.0] * 4, [0.0] * 4, [0.0, 0.0, -h, 0.0]])
    assert metrics["steps_per_completion"].item() == pytest.approx(2 / 3, abs=1e-6)
    assert metrics["step_reward_mean"].item() == pytest.approx(0.5, abs=1e-6)


def test_no_steps_at_all_gives_zeros_and_nan_mean():
    a, metrics = advantages([None, [], None, None], 2, 3)
    assert torch.equal(a, torch.zeros(4, 3))
    assert math.isnan(metrics["step_reward_mean"].item())
    assert metrics["steps_per_completion"].item() == 0.0


def test_weight_scales_every_token():
    a, _ = advantages(ONE_GROUP, 2, 5, scale="none", weight=2.5)
    assert_close(a, [[2.5, 2.5, -2.5, -2.5, 0.0], [-2.5, -2.5, -2.5, 0.0, 0.0]])


def test_steps_ending_at_the_same_token_add():
    # pooled [1, 1, 4]: mean 2, r~ ("none") = [-1, -1, 2]; completion 0's two steps both end at token 0
    a, _ = advantages([[(0, 1.0), (0, 1.0)], [(1, 4.0)]], 2, 3, scale="none")
    assert_close(a, [[-2.0, 0.0, 0.0], [2.0, 2.0, 0.0]])


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="scale_rewards='std'"):
        advantages(ONE_GROUP, 2, 5, scale="std")
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        advantages(ONE_GROUP, 3, 5)
    with pytest.raises(ValueError, match=r"completion 1 ends at token index 5, outside \[0, 4\]"):
        advantages([[(1, 1.0)], [(5, 0.0)]], 2, 5)
    with pytest.raises(ValueError, match="completion 0 ending at token 1 has non-finite reward nan"):
        advantages([[(1, math.nan)], []], 2, 5)


def naive_process_advantages(steps, group_size, num_tokens, scale, weight):
    """Python loops over groups, steps and tokens, straight from the formula."""
    n = len(steps)
    pooled_all = [r for entry in steps for _, r in (entry or [])]
    out = [[0.0] * num_tokens for _ in range(n)]
    for g in range(0, n, group_size):
        pooled = [r for entry in steps[g : g + group_size] for _, r in (entry or [])]
        if len(pooled) < 2 or max(pooled) == min(pooled):
            continue
        mean = sum(pooled) / len(pooled)
        std = lambda xs: math.sqrt(sum((x - sum(xs) / len(xs)) ** 2 for x in xs) / (len(xs) - 1))  # noqa: E731
        s = {"group": std(pooled), "batch": std(pooled_all), "none": 1.0}[scale]
        for i in range(g, g + group_size):
            for t in range(num_tokens):
                out[i][t] = weight * sum((r - mean) / s for end, r in (steps[i] or []) if end >= t)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_a_naive_loop_on_random_inputs(seed, scale):
    rng = random.Random(seed)
    group_size, num_tokens = rng.choice([1, 2, 4]), rng.randint(1, 12)
    steps = []
    for _ in range(group_size * rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.15:
            steps.append(None)
            continue
        ends = sorted(rng.sample(range(num_tokens), rng.randint(0, min(4, num_tokens))))
        # a few small integer rewards make flat groups and ties likely
        steps.append([(e, float(rng.choice([0, 1, 2])) if kind < 0.4 else rng.gauss(0, 3)) for e in ends])
    weight = rng.uniform(-2, 2)
    a, _ = advantages(steps, group_size, num_tokens, scale=scale, weight=weight)
    expected = naive_process_advantages(steps, group_size, num_tokens, scale, weight)
    assert torch.allclose(a, expected, atol=1e-5, rtol=1e-5)


# --- splitting completions into steps ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, ends",
    [
        ("a\nb\n", [2, 4]),  # each line ends after its newline
        ("a\nbc", [2, 4]),  # a last line without newline ends at len(text)
        ("\n\na\n  \n\tb", [4, 9]),  # blank and whitespace-only lines are skipped
        ("one line", [8]),
        ("", []),
        ("\n \n", []),
        ("x\r\ny\r\n", [3, 6]),
    ],
)
def test_split_lines(text, ends):
    assert split_steps(text) == ends
    assert split_steps(text, r"\n") == ends  # "line" is the regex \n


def test_split_on_a_regex_separator():
    assert split_steps("x=1. y=2. ", r"\.\s*") == [5, 10]  # the separator ". " ends the step
    assert split_steps("x=1. y=2. z", r"\.\s*") == [5, 10, 11]  # text after the last separator
    assert split_steps("..a..b", r"\.") == [4, 6]  # blank pieces between separators are skipped
    # a zero-width separator before each "Step": the first (at 0) cuts off nothing
    text = "Step 1: a\nStep 2: b"
    assert split_steps(text, r"(?=Step \d+:)") == [10, 19]
    assert split_steps("a line b", re.compile("line")) == [6, 8]  # a compiled pattern is a regex too
    assert step_spans("a. b", r"\.\s*") == [(0, 1, 3), (3, 4, 4)]  # (start, content end, end)


def test_step_reward_scores_each_step_with_prompt_and_columns():
    seen = []

    def check(step, prompt, answer, **kwargs):
        seen.append((step, prompt, answer))
        return None if step == "skip" else float(answer in step)

    reward = StepReward(check)
    assert reward.name == reward.__name__ == "check"
    completions = ["a 4\nskip\nb 5", [{"role": "assistant", "content": "\n4"}]]
    out = reward(prompts=["p0", "p1"], completions=completions, answer=["4", "4"], completion_ids=[[1], [2]],
                 trainer_state=None)
    assert out == [[(4, 1.0), (12, 0.0)], [(2, 1.0)]]
    assert seen == [("a 4", "p0", "4"), ("skip", "p0", "4"), ("b 5", "p0", "4"), ("4", "p1", "4")]
    named = StepReward(lambda step, prompt, **k: 1.0, by=r";", name="semi")
    assert named.__name__ == "semi" and named(["p"], ["a;b;"]) == [[(2, 1.0), (4, 1.0)]]


# --- character offsets -> token indices ----------------------------------------------------------------------


def byte_level_bpe(clean_up_tokenization_spaces=False):
    """A byte-level BPE tokenizer like Qwen2's (ByteLevel pre-tokenizer and decoder), trained here offline."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<pad>", "<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["Step 1: compute 12 + 30 = 42.\nStep 2: café naïve résumé.\n", "x = 1\ny = 2\n"] * 50
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
        clean_up_tokenization_spaces=clean_up_tokenization_spaces,
    )


@pytest.fixture(scope="module")
def bpe():
    return byte_level_bpe()


TEXTS = [
    "Step 1: compute 12 + 30 = 42.\nStep 2: café",
    "Step 1: 🙂 café 日本語 x = 1\n\nStep 2: naïve ∑ done.",  # multi-byte characters split over tokens
    "🙂🙂\n",
    "a \ufffd b",  # a real replacement character in the text
    "",
]


def agreed_prefix(tokenizer, ids, text, t):
    return len(os.path.commonprefix([tokenizer.decode(ids[: t + 1], skip_special_tokens=True), text]))


@pytest.mark.parametrize("text", TEXTS)
def test_token_char_ends_on_a_byte_level_bpe(bpe, text):
    ids = bpe.encode(text, add_special_tokens=False) + [bpe.eos_token_id]
    assert any(bpe.decode([i]) == "\ufffd" for i in bpe.encode("🙂", add_special_tokens=False))  # partial UTF-8
    ends = token_char_ends(bpe, ids)
    assert len(ends) == len(ids) and ends[-1] == len(text)
    assert all(a <= b for a, b in zip(ends, ends[1:]))
    best = 0
    for t in range(len(ids)):  # the definition: the longest agreed prefix, made non-decreasing
        best = max(best, agreed_prefix(bpe, ids, text, t))
        assert ends[t] == best
    assert ends == _prefix_ends(bpe, ids, text)


def test_a_character_belongs_to_the_token_that_completes_it(bpe):
    text = "ab🙂c"
    ids = bpe.encode(text, add_special_tokens=False)
    ends = token_char_ends(bpe, ids)
    emoji_end = text.index("🙂") + 1
    t = offsets_to_token_indices(ends, [emoji_end])[0]
    assert bpe.decode(ids[: t + 1]).startswith(text[:emoji_end])
    assert not bpe.decode(ids[:t]).startswith(text[:emoji_end])
    assert bpe.decode(ids[t - 1 : t]) == "\ufffd"  # the tokens before it hold the emoji's first bytes


def test_slow_path_gives_the_same_ends_on_long_random_text(bpe):
    rng = random.Random(0)
    pieces = ["Step 1: café ", "🙂", " 日本", "x = 1\n", "résumé ", "\ufffd", " , ."]
    text = "".join(rng.choice(pieces) for _ in range(200))
    for tokenizer in (bpe, byte_level_bpe(clean_up_tokenization_spaces=True)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=True)
        fast = _incremental_ends(tokenizer, ids, decoded)
        assert fast is None or fast == _prefix_ends(tokenizer, ids, decoded)
        assert token_char_ends(tokenizer, ids) == _prefix_ends(tokenizer, ids, decoded)


def test_prefix_decodes_are_the_fallback(bpe, monkeypatch):
    import grpokit.rewards.steps as steps_module

    text = TEXTS[1]
    ids = bpe.encode(text, add_special_tokens=False)
    fast = token_char_ends(bpe, ids)
    monkeypatch.setattr(steps_module, "_incremental_ends", lambda tokenizer, ids, text: None)
    assert token_char_ends(bpe, ids) == fast


def test_token_char_ends_with_special_tokens_in_the_middle():
    tok = char_tokenizer()
    ids = tok.encode("ab", add_special_tokens=False) + [tok.eos_token_id] + tok.encode("c", add_special_tokens=False)
    assert token_char_ends(tok, ids) == [1, 2, 2, 3]  # <eos> is skipped in the decode: it adds no characters
    assert token_char_ends(tok, []) == []


def test_offsets_to_token_indices():
    ends = [2, 2, 5, 7]
    assert offsets_to_token_indices(ends, [1, 2, 3, 5, 6, 7, 9]) == [0, 0, 2, 2, 3, 3, 3]
    assert offsets_to_token_indices(ends, []) == []
    assert offsets_to_token_indices([], []) == []
    with pytest.raises(ValueError, match="no tokens"):
        offsets_to_token_indices([], [1])


def test_step_reward_to_token_advantages_end_to_end():
    """StepReward -> score_completions -> offsets -> token indices -> process_advantages, one-token characters."""
    tok = char_tokenizer()
    texts = ["ok\nbad\n", "ok\nok"]
    ids = [tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in texts]
    reward = StepReward(lambda step, prompt, **k: 1.0 if step == "ok" else 0.0)
    scores = score_completions(resolve_reward_funcs([reward]), ["p", "p"], texts, ids, {}, None)
    steps = scores.steps[0]
    assert steps == [[(3, 1.0), (7, 0.0)], [(3, 1.0), (5, 1.0)]]
    token_steps = []
    for entry, completion_ids in zip(steps, ids):
        ends = token_char_ends(tok, completion_ids)
        indices = offsets_to_token_indices(ends, [offset for offset, _ in entry])
        token_steps.append([(j, r) for j, (_, r) in zip(indices, entry)])
    assert token_steps == [[(2, 1.0), (6, 0.0)], [(2, 1.0), (4, 1.0)]]  # the token of each step's "\n"
    a, _ = process_advantages(token_steps, 2, 8, scale_rewards="none")
    # pooled [1, 0, 1, 1]: mean 0.75, r~ = [0.25, -0.75, 0.25, 0.25]
    assert_close(a, [[-0.5] * 3 + [-0.75] * 4 + [0.0], [0.5] * 3 + [0.25] * 2 + [0.0] * 3])


# --- the contract --------------------------------------------------------------------------------------------

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["alpha", "beta", "gamma"]
IDS = [[5, 6], [7], [8, 9, 10]]


def score(funcs, error_policy="raise", completions=COMPLETIONS):
    return score_completions(resolve_reward_funcs(funcs), PROMPTS, completions, IDS, {}, None, error_policy)


def returning(values, name="stepper"):
    def fn(completions, **kwargs):
        return values

    fn.__name__ = name
    return fn


def test_step_lists_are_validated_and_returned_beside_outcome_columns():
    steps = returning([[(2, 1.0), (5, np.float32(0.5))], None, ([np.int64(1), torch.tensor(2.0)],)])
    result = score([steps, returning([1.0, 2.0, None], "outcome")])
    assert torch.isnan(result.rewards[:, 0]).all()  # a process function's column is NaN: outcome math skips it
    assert result.rewards[:2, 1].tolist() == [1.0, 2.0]
    assert result.steps == [[[(2, 1.0), (5, 0.5)], None, [(1, 2.0)]], None]
    assert all(type(o) is int and type(r) is float for o, r in result.steps[0][2])
    assert result.failures == [0, 0]


def test_empty_lists_and_all_none():
    assert score([returning([[], None, []])]).steps == [[[], None, []]]
    result = score([returning([None, None, None])])  # the kind is not shown: treated as an outcome function
    assert result.steps == [None] and torch.isnan(result.rewards).all()
    assert score_completions(resolve_reward_funcs([returning([])]), [], [], [], {}, None).steps == [None]


def test_async_function_returning_step_lists():
    async def async_steps(completions, **kwargs):
        await asyncio.sleep(0)
        return [[(len(c), float(len(c)))] for c in completions]

    assert score([async_steps]).steps == [[[(5, 5.0)], [(4, 4.0)], [(5, 5.0)]]]


def test_conversational_completions_are_measured_by_their_text():
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    assert score([returning([[(5, 1.0)], [(4, 1.0)], [(5, 1.0)]])], completions=completions).steps[0][1] == [(4, 1.0)]
    with pytest.raises(RewardError, match="outside 1..4"):
        score([returning([[(5, 1.0)], [(5, 1.0)], [(5, 1.0)]])], completions=completions)


@pytest.mark.parametrize(
    "values, index, problem",
    [
        ([[(1, 1.0)], 0.5, None], 1, "0.5 of type float is not a list of (end_offset, reward) steps, but sample 0"),
        ([None, 0.5, [(1, 1.0)]], 2, "is a list (of steps?), not a real number, but sample 1 returned a number"),
    ],
)
def test_mixing_numbers_and_step_lists_is_an_error(values, index, problem):
    with pytest.raises(RewardError) as info:
        score([returning(values)])
    message = str(info.value)
    assert "reward function 'stepper'" in message and f"sample {index}" in message and problem in message
    assert "not both kinds in one batch" in message


@pytest.mark.parametrize(
    "step, problem",
    [
        ((0, 1.0), "step 0 ends at offset 0, outside 1..5 (the completion has 5 characters)"),
        ((6, 1.0), "step 0 ends at offset 6, outside 1..5"),
        ((2.0, 1.0), "end offset 2.0 of type float, not an int"),
        ((True, 1.0), "end offset True of type bool, not an int"),
        ((np.bool_(True), 1.0), "of type bool, not an int"),
        ((2, float("nan")), "step 0 has reward nan is not finite"),
        ((2, float("inf")), "inf is not finite"),
        ((2, None), "step 0 has reward None"),
        ((2, "1"), "is not a real number"),
        ((2,), "step 0 is (2,), not an (end_offset, reward) pair"),
        ((1, 2, 3), "not an (end_offset, reward) pair"),
        (2, "step 0 is 2, not an (end_offset, reward) pair"),
    ],
)
def test_invalid_step_raises_with_name_sample_and_fix(step, problem):
    with pytest.raises(RewardError) as info:
        score([returning([[step], [], []])])
    message = str(info.value)
    assert "reward function 'stepper' returned an invalid value for sample 0" in message and problem in message
    assert "'alpha'" in message and "Fix: return one list of (end_offset, reward) pairs per completion" in message


def test_offsets_must_increase_strictly():
    for steps in ([(3, 1.0), (3, 1.0)], [(4, 1.0), (2, 0.0)]):
        with pytest.raises(RewardError, match=r"step 1 ends at offset \d, not after step 0 \(offset \d\)"):
            score([returning([steps, None, None])])


def test_invalid_steps_under_policy_none_become_none_and_are_counted():
    values = [[(0, 1.0)], [(2, 1.0)], 0.5]  # a bad offset, a good step list, a number among step lists
    result = score([returning(values), returning([1.0, 1.0, 1.0], "outcome")], error_policy="none")
    assert result.steps[0] == [None, [(2, 1.0)], None]
    assert result.failures == [2, 0]
    assert torch.isnan(result.rewards[:, 0]).all() and result.rewards[:, 1].tolist() == [1.0] * 3


def test_raising_process_function_under_policy_none_has_no_steps():
    def broken(completions, **kwargs):
        raise ValueError("boom")

    result = score([broken, returning([[(1, 1.0)], None, None])], error_policy="none")
    assert result.steps == [None, [[(1, 1.0)], None, None]] and result.failures == [3, 0]

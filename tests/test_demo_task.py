"""The demo task: problem split, prompt and solution text, answer extraction, rewards, greedy evaluation."""

import random

import pytest
import torch

from grpokit.demo.task import (
    NUM_HELDOUT,
    Problem,
    all_problems,
    column_sums,
    correctness_reward,
    evaluate,
    extract_answer,
    format_reward,
    parse_int,
    solution,
    split_problems,
    write_splits,
)
from grpokit.demo.warmup import malformed, no_carry_completion, noisy_completion
from grpokit.tiny import char_tokenizer
from vllm_support import requires_vllm


def test_split_is_deterministic_disjoint_and_complete():
    train, held_out = split_problems()
    assert (train, held_out) == split_problems()
    assert not set(train) & set(held_out)
    assert set(train) | set(held_out) == set(all_problems())
    assert NUM_HELDOUT <= len(held_out) <= NUM_HELDOUT + 1  # a commuted pair is added as a whole
    assert len(all_problems()) == 90 * 90


def test_split_keeps_commuted_pairs_on_one_side():
    train, held_out = split_problems()
    held = set(held_out)
    assert all(Problem(p.b, p.a) in held for p in held_out)
    assert not any(Problem(p.b, p.a) in held for p in train)


def test_split_depends_on_its_seed():
    assert split_problems(seed=1)[1] != split_problems(seed=2)[1]


def test_prompt_answer_and_solution_text():
    p = Problem(47, 38)
    assert p.prompt == "47+38="
    assert p.row() == {"prompt": "47+38=", "answer": 85}
    assert column_sums(47, 38) == (15, 8)
    assert column_sums(47, 38, carry=False) == (15, 7)
    assert solution(p) == "<t>15,8</t><a>85</a>"
    assert solution(Problem(87, 58)) == "<t>15,14</t><a>145</a>"
    assert solution(Problem(12, 13)) == "<t>5,2</t><a>25</a>"


def test_no_carry_mistake():
    assert no_carry_completion(Problem(47, 38)) == "<t>15,7</t><a>75</a>"
    assert no_carry_completion(Problem(87, 58)) == "<t>15,13</t><a>35</a>"
    # Without any carry the "mistake" is the right answer.
    assert no_carry_completion(Problem(12, 13)) == solution(Problem(12, 13))


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<t>15,8</t><a>85</a>", "85"),
        ("<t>x</t><a> 85 </a>", "85"),
        ("<a>7</a><a>8</a>", "7"),  # the first answer counts
        ("<t>15,8</t><a></a>", ""),
        ("<t>15,8</t>85", None),
        ("<t>15,8</t><a>85", None),
        ("85", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_parse_int():
    assert parse_int("85") == 85
    assert parse_int("085") == 85
    assert parse_int("-3") == -3
    assert parse_int("8 5") is None
    assert parse_int("") is None
    assert parse_int(None) is None


def test_format_reward_hand_worked():
    completions = [
        "<t>15,8</t><a>85</a>",  # well-formed, right
        "<t>15,7</t><a>75</a>",  # well-formed, wrong: format does not judge the answer
        "<t></t><a>85</a>",  # empty reasoning is still the format
        "<t>15,8</t><a>85</a>\n",  # trailing whitespace is tolerated
        "<t>15,8</t><a></a>",  # empty answer
        "<a>85</a>",  # no reasoning
        "<t>15,8</t>85",  # answer outside the tags
        "<t>15,8</t><a>85",  # unclosed
        "85",  # bare
        "<t>15,8</t><a>85</a>x",  # trailing text
    ]
    assert format_reward(["47+38="] * len(completions), completions) == [1.0] * 4 + [-1.0] * 6


def test_correctness_reward_hand_worked():
    completions = ["<t>15,8</t><a>85</a>", "<t>15,7</t><a>75</a>", "<a>85</a>", "85", "<t>15,8</t><a>085</a>", "<a>8a</a>"]
    answers = [85, 85, 85, 85, 85, 85]
    rewards = correctness_reward(["47+38="] * 6, completions, answer=answers)
    # Right in tags, wrong, right without reasoning (format reward penalises that), bare, leading zero, not a number.
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_rewards_take_extra_columns_and_conversational_completions():
    completions = [[{"role": "assistant", "content": "<t>5,2</t><a>25</a>"}]]
    assert format_reward(["12+13="], completions, answer=[25], trainer_state=None) == [1.0]
    assert correctness_reward(["12+13="], completions, answer=["25"], completion_ids=[[0]]) == [1.0]


def test_correctness_reward_needs_one_answer_per_completion():
    with pytest.raises(ValueError):
        correctness_reward(["1+1="], ["<a>2</a>", "<a>2</a>"], answer=[2])


def test_noisy_completions_mix_right_wrong_and_malformed():
    rng = random.Random(0)
    p = Problem(47, 38)
    samples = [noisy_completion(p, rng, p_correct=0.35, p_malformed=0.1) for _ in range(2000)]
    formats = format_reward([p.prompt] * len(samples), samples)
    correct = correctness_reward([p.prompt] * len(samples), samples, answer=[p.answer] * len(samples))
    assert 0.05 < formats.count(-1.0) / len(samples) < 0.15
    well_formed_right = sum(1 for f, c in zip(formats, correct) if f > 0 and c > 0) / len(samples)
    assert 0.25 < well_formed_right < 0.40


def test_every_malformed_variant_fails_the_format():
    rng = random.Random(0)
    broken = {malformed(solution(Problem(47, 38)), rng) for _ in range(200)}
    assert len(broken) == 5
    assert format_reward([""] * len(broken), sorted(broken)) == [-1.0] * len(broken)


class FakeModel:
    """Stands in for a causal LM: "generates" the correct solution when a is even, the no-carry mistake otherwise.

    It checks that the prompts arrive left-padded, as batched generation needs.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.training = True
        self.device = torch.device("cpu")
        self.calls = 0

    def eval(self):
        self.training = False
        return self

    def train(self, mode=True):
        self.training = mode
        return self

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        self.calls += 1
        assert kwargs["do_sample"] is False
        assert bool(attention_mask[:, -1].all()), "prompts must be left-padded"
        rows = []
        for ids in input_ids:
            a, b = self.tokenizer.decode(ids, skip_special_tokens=True).removesuffix("=").split("+")
            problem = Problem(int(a), int(b))
            text = solution(problem) if problem.a % 2 == 0 else no_carry_completion(problem)
            new = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
            rows.append(new[:max_new_tokens])
        width = max(map(len, rows))
        pad = self.tokenizer.pad_token_id
        new_tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new_tokens], dim=1)


def test_evaluate_on_a_fake_model():
    tokenizer = char_tokenizer()
    model = FakeModel(tokenizer)
    # 5+38 has a shorter prompt, so its batch needs padding; batch_size=2 makes three batches.
    problems = [Problem(47, 38), Problem(5, 38), Problem(12, 13), Problem(87, 58), Problem(88, 58)]
    # Right: 12+13 (no carry, so the mistake is right), 88+58 (even). Wrong: 47+38, 5+38, 87+58.
    assert evaluate(model, tokenizer, problems, batch_size=2) == pytest.approx(2 / 5)
    assert model.calls == 3
    assert model.training is True  # the mode is restored
    assert tokenizer.padding_side == "right"  # and so is the tokenizer's padding side


def test_evaluate_rejects_no_problems():
    with pytest.raises(ValueError):
        evaluate(FakeModel(char_tokenizer()), char_tokenizer(), [])


def test_write_splits_round_trips(tmp_path):
    import json

    train_path, held_out_path = write_splits(tmp_path)
    train, held_out = split_problems()
    rows = [json.loads(line) for line in held_out_path.read_text().splitlines()]
    assert rows == [p.row() for p in held_out]
    assert len(train_path.read_text().splitlines()) == len(train)


def test_plot_curves_reads_the_trainer_metrics(tmp_path):
    import json

    from grpokit.demo.run import plot_curves, read_metrics

    rows = [
        {"step": s, "loss": 0.0, "kl": 0.01 * s, "completions/mean_length": 20 + s,
         "rewards/format_reward/mean": 0.5, "rewards/correctness_reward/mean": 0.1 * s}
        for s in (1, 2, 3)
    ]
    rows.append({"step": 3, "eval/reward": 1.0})  # eval rows have no loss and are not training curves
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curve.png", title="t")
    assert (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_run_demo_end_to_end(tmp_path):
    import json

    from grpokit.demo.run import run_demo

    summary = run_demo(tmp_path / "demo", steps=2, seed=0)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert saved == summary
    assert {"accuracy_before", "accuracy_after", "steps", "wall_seconds"} <= set(summary)
    assert summary["steps"] == 2
    assert 0.15 < summary["accuracy_before"] < 0.45  # the shipped warm model: format known, carry mostly forgotten
    assert (tmp_path / "demo" / "reward_curve.png").is_file()
    assert (tmp_path / "demo" / "model.safetensors").is_file()


@pytest.mark.slow
@requires_vllm
def test_demo_learns_with_vllm_colocate(tmp_path):
    """The issue's bar for the vLLM engine: the demo's held-out accuracy rises by at least 20 points (measured:
    26.7% -> 99.0% in 56 s with the default 100 steps, seed 0)."""
    from grpokit.demo.run import run_demo

    summary = run_demo(tmp_path / "demo", seed=0, use_vllm=True)
    assert summary["rollout_engine"] == "vllm (colocate)"
    assert summary["accuracy_gain"] >= 0.20, summary


def test_a_demo_stopped_by_a_signal_claims_nothing(tmp_path, monkeypatch, capsys):
    import os
    import signal

    from grpokit.demo.run import run_demo
    from grpokit.train.trainer import GRPOTrainer

    step = GRPOTrainer.train_step

    def step_then_sigterm(self):
        row = step(self)
        os.kill(os.getpid(), signal.SIGTERM)  # as `timeout` does: the trainer stops after this step, with a checkpoint
        return row

    monkeypatch.setattr(GRPOTrainer, "train_step", step_then_sigterm)
    summary = run_demo(tmp_path / "demo", steps=50, seed=0)
    assert summary == {"interrupted": "SIGTERM", "steps": 1}
    out = capsys.readouterr().out
    assert "grpo demo: stopped by SIGTERM after step 1 of 50: no held-out accuracy was measured" in out
    assert "held-out accuracy 26" not in out and not (tmp_path / "demo" / "summary.json").exists()
    assert (tmp_path / "demo" / "checkpoint-1").is_dir()

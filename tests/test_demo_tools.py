"""The tool demo: its task, the warm-up transcripts (tool tokens never labels), greedy multi-turn evaluation, the
YAML twin, and the demo itself (held-out accuracy up by at least 20 points)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpokit.demo.tools_task import (
    MAX_COMPLETION_LENGTH,
    Problem,
    calc,
    correctness_reward,
    evaluate,
    extract_answer,
    split_problems,
)
from grpokit.demo.tools_warmup import ToolWarmupConfig, make_batch, transcript
from grpokit.tiny import char_tokenizer
from vllm_support import requires_vllm

ROOT = Path(__file__).resolve().parent.parent


def test_split_is_disjoint_complete_and_keeps_commuted_pairs_together():
    train, held_out = split_problems()
    assert len(train) + len(held_out) == 90 * 90 and len(held_out) == 400
    assert not set(train) & set(held_out)
    assert all(Problem(p.b, p.a) in set(held_out) for p in held_out)


def test_reward_reads_the_last_answer_of_the_transcript():
    completions = ["<call>calc(47*38)</call><result>1786</result><a>1786</a>", "<a>1790</a>", "<a>1786",
                   "<a>12</a><a>1786</a>", "no answer"]
    assert correctness_reward([], completions, [1786] * 5) == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert extract_answer("<a> 42 </a>") == 42 and extract_answer("<a>4x</a>") is None
    assert calc("47*38") == "1786"


def test_warmup_transcripts_label_only_the_models_tokens():
    tok, rng = char_tokenizer(), random.Random(0)
    config = ToolWarmupConfig(p_tool=1.0, p_miscopy=0.0)
    problem = Problem(47, 38)
    segments = transcript(problem, rng, config)
    assert segments == [("<call>calc(47*38)</call>", True), ("<result>1786</result>", False), ("<a>1786</a>", True)]
    ids, attention, labels = make_batch(tok, [problem], [segments])
    text = tok.decode(ids[0][attention[0].bool()])
    assert text == "47*38=<call>calc(47*38)</call><eos><result>1786</result><a>1786</a><eos>"
    labelled = tok.decode(labels[0][labels[0] >= 0])
    assert labelled == "<call>calc(47*38)</call><eos><a>1786</a><eos>"  # no prompt, no tool result
    guesses = [transcript(problem, rng, ToolWarmupConfig(p_tool=0.0, p_lucky_guess=0.0)) for _ in range(50)]
    assert all(len(g) == 1 and extract_answer(g[0][0]) != 1786 for g in guesses)


def test_greedy_evaluation_runs_the_tool_loop():
    """A fake model that always calls the tool and then copies the result scores 100% with a 100% call rate."""
    tok = char_tokenizer()

    class Copier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
            rows = []
            for ids, mask in zip(input_ids, attention_mask):
                text = tok.decode(ids[mask.bool()], skip_special_tokens=True)
                if "<result>" in text:
                    reply = "<a>" + text.split("<result>")[1].split("</result>")[0] + "</a>"
                else:
                    reply = "<call>calc(" + text.split("=")[0] + ")</call>"
                new = tok(reply, add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [tok.eos_token_id]
                rows.append(ids.tolist() + new)
            width = max(map(len, rows))
            return torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])

    problems = split_problems()[1][:30]
    result = evaluate(Copier(), tok, problems, batch_size=7)
    assert (result["accuracy"], result["tool_call_rate"], result["accuracy_with_call"]) == (1.0, 1.0, 1.0)
    assert result["accuracy_without_call"] is None  # no episode answered without the tool: null in summary.json
    assert MAX_COMPLETION_LENGTH >= len("<call>calc(99*99)</call>") + 1 + len("<result>9801</result><a>9801</a>") + 1


def test_the_tools_yaml_trains_with_tools_and_scores_the_held_out_split(tmp_path):
    out = tmp_path / "tools"
    result = subprocess.run(
        [sys.executable, "-m", "grpokit.cli", "train", "examples/tools.yaml", "--output_dir", str(out),
         "--max_steps", "2", "--disable_tqdm", "true", "--eval_strategy", "steps", "--eval_steps", "2",
         "--per_device_eval_batch_size", "400", "--num_generations_eval", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert len(train_rows) == 2 and all(r["tools/call_frequency"] > 0 for r in train_rows)
    evals = [r for r in rows if "eval/reward" in r]
    assert evals and "eval/tools/call_frequency" in evals[-1] and "eval/completions/tool_tokens_mean" in evals[-1]


@pytest.mark.slow
def test_tool_demo_learns_to_call_the_calculator(tmp_path):
    """The issue's bar: held-out accuracy up by at least 20 points in at most 10 minutes, tool-call rate reported
    (measured: 0.8% -> 79.0%, calls 0% -> 100%, 36 s, seed 0, 2-core CPU; seeds 1 and 2: 79.0%, 80.0%)."""
    result = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--task", "tools", "--output-dir",
                             str(tmp_path / "demo")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["accuracy_gain"] >= 0.20, summary
    assert summary["tool_call_rate_after"] > summary["tool_call_rate_before"] + 0.5, summary
    assert summary["wall_seconds"] < 600
    assert (tmp_path / "demo" / "tool_curves.png").stat().st_size > 10_000
    assert "held-out accuracy" in result.stdout and "tool-call rate" in result.stdout


@pytest.mark.slow
@requires_vllm
def test_tool_demo_learns_with_vllm_colocate(tmp_path):
    """The same bar with every turn generated by vLLM (measured: 0.8% -> 79.0%, calls 0% -> 99.8%, 66 s)."""
    from grpokit.demo.tools_run import run_tools_demo

    summary = run_tools_demo(tmp_path / "demo", seed=0, use_vllm=True)
    assert summary["rollout_engine"] == "vllm (colocate)"
    assert summary["accuracy_gain"] >= 0.20, summary
    assert summary["tool_call_rate_after"] > 0.5, summary


def test_summary_is_strict_json_and_held_out_rows_frame_the_metrics(tmp_path):
    from grpokit.demo.run import log_held_out, write_summary
    from grpokit.observe.report import load_run, render

    write_summary(tmp_path, {"accuracy_after": 0.79, "accuracy_without_call_after": float("nan"), "none": None})
    text = (tmp_path / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text) == {"accuracy_after": 0.79, "accuracy_without_call_after": None,
                                                      "none": None}
    rows = [{"step": s, "loss": 0.0, "reward": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log_held_out(tmp_path, 3, {"accuracy": 0.01, "tool_call_rate": 0.0}, {"accuracy": 0.79, "tool_call_rate": 1.0})
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged[0] == {"step": 0, "eval/held_out_accuracy": 0.01, "eval/held_out_tool_call_rate": 0.0}
    assert logged[1:4] == rows and logged[4]["eval/held_out_accuracy"] == 0.79 and logged[4]["step"] == 3
    page = render(load_run(tmp_path))  # the report's Evaluation card and summary show the held-out accuracy
    assert 'id="plot-eval" data-metric="eval/held_out_accuracy"' in page
    assert "0.01 (step 0) &rarr; 0.79 (step 3)" in page


def test_the_demos_expected_alarms_are_explained(tmp_path):
    from grpokit.demo.tools_run import EXPECTED_ALARMS, explain_health
    from grpokit.observe.health import ALARM_TITLES

    assert set(EXPECTED_ALARMS) <= set(ALARM_TITLES)
    rows = [{"step": s, "loss": 0.0, "reward": 0.5, "entropy": 0.3 if s <= 5 else 0.02} for s in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    note = explain_health(tmp_path)
    assert note.splitlines()[1].startswith("  Entropy collapse (step 8): the task has one right procedure")
    assert json.loads((tmp_path / "expected_alarms.json").read_text()) == EXPECTED_ALARMS

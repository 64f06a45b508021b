"""Two processes on CPU (gloo) against one process with the same global batch and seed."""

import os
import sys
from pathlib import Path

import pytest

from helpers import read_jsonl
from procs import run_tree

SCRIPT = str(Path(__file__).parent / "scripts" / "train_tiny.py")
pytestmark = pytest.mark.slow


def _launch(args, processes, timeout=150):
    # TORCH_DISTRIBUTED_DEBUG=DETAIL would check collective shapes, but it segfaults gloo in torch 2.13
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if processes == 1:
        command = [sys.executable, SCRIPT, *args]
    else:
        # accelerate starts CPU workers through torchrun only under --multi_gpu; the trainer selects gloo on CPU
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", "0", SCRIPT, *args]
    # A hang at exit must fail the test, never stall the suite: run_tree kills launcher and workers together.
    return run_tree(command, timeout, env=env)


def _one_and_two_processes(tmp_path, model_dir, common):
    """The same 3-step run with 16 completions per step on one process and 8 per process on two: metric rows."""
    one = _launch([model_dir, str(tmp_path / "one"), "--per_device_train_batch_size", "16", *common], 1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _launch([model_dir, str(tmp_path / "two"), "--per_device_train_batch_size", "8", *common], 2)
    assert two.returncode == 0, two.stderr[-3000:]
    rows_one, rows_two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(rows_one) == len(rows_two) == 3
    return rows_one, rows_two


def test_two_processes_match_one_process(tmp_path, tiny_model_dir):
    common = ["--max_steps", "3", "--num_iterations", "2", "--beta", "0.05", "--loss_type", "dapo"]
    rows_one, rows_two = _one_and_two_processes(tmp_path, tiny_model_dir, common)
    for a, b in zip(rows_one, rows_two):
        for key in ("reward", "reward_std", "rewards/short/mean", "frac_reward_zero_std", "completions/mean_length",
                    "completions/max_length", "clip_ratio/region_mean", "learning_rate"):
            assert a[key] == b[key], key  # same completions, same rewards: exactly equal
        for key in ("loss", "kl", "grad_norm", "ratio_mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    completions = read_jsonl(tmp_path / "two" / "completions.jsonl")
    assert len(completions) == 16  # both processes' samples are gathered into the log


def test_token_budgeted_forwards_on_two_processes_match_one_process(tmp_path, tiny_model_dir):
    """token_budget cuts each process's samples into its own forwards (the processes then run as many, with
    zero-weight fillers where one has fewer): the run equals one process's, whose forwards differ again."""
    common = ["--max_steps", "3", "--num_iterations", "2", "--beta", "0.05", "--loss_type", "grpo",
              "--max_prompt_length", "12", "--token_budget", "30"]
    rows_one, rows_two = _one_and_two_processes(tmp_path, tiny_model_dir, common)
    for a, b in zip(rows_one, rows_two):
        for key in ("reward", "completions/mean_length"):
            assert a[key] == b[key], key
        for key in ("loss", "kl", "grad_norm", "ratio_mean", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key


def test_dynamic_sampling_entropy_mask_and_kl_in_reward_match_one_process(tmp_path, tiny_model_dir):
    """Groups move between processes (dynamic sampling), the entropy threshold is taken over both processes'
    tokens, and the KL penalty is gathered before advantages: two processes still give one process's run."""
    common = ["--max_steps", "3", "--beta", "0.05", "--kl_in_reward", "true", "--dynamic_sampling", "true",
              "--top_entropy_quantile", "0.5", "--flat-even", "1", "--log_completions", "false"]
    rows_one, rows_two = _one_and_two_processes(tmp_path, tiny_model_dir, common)
    assert rows_one[0]["dynamic_sampling/dropped_groups"] > 0  # the even prompts' groups were dropped
    for a, b in zip(rows_one, rows_two):
        for key in ("reward", "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups",
                    "completions/mean_length", "frac_reward_zero_std"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
        for key in ("loss", "grad_norm", "entropy", "entropy_mask_fraction", "rewards/kl_penalty/mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_multi_turn_episodes_on_two_processes_match_one_process(tmp_path, tiny_model_dir):
    """Tool-calling episodes, with groups moving between processes (dynamic sampling): every process runs its own
    episodes, groups are scored whole, and the run equals the one-process run."""
    common = ["--max_steps", "3", "--beta", "0.05", "--tools-every-turn", "1", "--max_completion_length", "24",
              "--max_tool_calling_iterations", "2", "--dynamic_sampling", "true", "--flat-even", "1"]
    rows_one, rows_two = _one_and_two_processes(tmp_path, tiny_model_dir, common)
    assert rows_one[0]["tools/call_frequency"] > 0 and rows_one[0]["dynamic_sampling/dropped_groups"] > 0
    for a, b in zip(rows_one, rows_two):
        for key in ("reward", "tools/call_frequency", "tools/turns_mean", "completions/tool_tokens_mean",
                    "completions/mean_length", "dynamic_sampling/rounds"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_reward_raising_on_one_rank_stops_both_with_the_same_error(tmp_path, tiny_model_dir):
    result = _launch([tiny_model_dir, str(tmp_path / "out"), "--per_device_train_batch_size", "8",
                      "--max_steps", "2", "--raise-on-rank", "1"], 2, timeout=180)
    assert result.returncode != 0
    assert "fragile" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "Reward scoring failed on process 1" in result.stderr  # rank 0 reports rank 1's error

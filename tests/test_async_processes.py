"""Asynchronous rollouts in real processes: kill -9 at a random moment then resume, SIGTERM, two processes.

A resumed asynchronous run must log exactly (==) what the uninterrupted asynchronous run logs (timings aside) and
end at the same weights: the checkpoint holds the batches older weights made (rollouts_<rank>.pt) and the data
position after them, and the rest is regenerated with the same weights and seeds. Two processes (each its own
producer, the producers' collectives on their own process group) must give the one-process run.
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import read_jsonl
from procs import kill_after_checkpoint, kill_tree, run_tree, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = str(SCRIPTS / "train_tiny.py")
TIMINGS = {"step_seconds", "tokens_per_second", "generation_seconds", "async/training_wait_seconds",
           "async/generation_wait_seconds", "async/generation_busy_seconds", "async/overlap"}
STEPS = 8
SETTINGS = {
    "k1": ["--max_staleness", "1", "--loss_type", "grpo"],
    # two versions behind, a reused batch with a KL term: made and partly used batches are both in checkpoints
    "k2_mu2_beta": ["--max_staleness", "2", "--num_iterations", "2", "--beta", "0.04"],
    "k1_tools": ["--max_staleness", "1", "--tools-every-turn", "1", "--max_completion_length", "24",
                 "--max_tool_calling_iterations", "2"],
    "k1_w2": ["--max_staleness", "1", "--weight_sync_steps", "2"],
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{SCRIPTS}")
pytestmark = pytest.mark.slow


def _command(model_dir, out, setting, *extra):
    return [sys.executable, SCRIPT, model_dir, str(out), "--max_steps", str(STEPS), "--completions_logging_steps",
            "1", *SETTINGS[setting], *extra]


def _two_processes(command):
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            *command[1:]]


def _comparable(rows):
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def _assert_same_run(out, reference_out, rel=None):
    rows, expected = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference_out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    if rel is None:
        assert _comparable(rows) == _comparable(expected)  # exact, every metric of every step
        assert read_jsonl(out / "completions.jsonl") == read_jsonl(reference_out / "completions.jsonl")
    else:
        for row, other in zip(_comparable(rows), _comparable(expected)):
            assert row.keys() == other.keys() and row == pytest.approx(other, rel=rel, abs=1e-6), row["step"]
    from safetensors.torch import load_file

    final, expected_final = load_file(out / "model.safetensors"), load_file(reference_out / "model.safetensors")
    for name in expected_final:
        if rel is None:
            assert torch.equal(final[name], expected_final[name]), name
        else:
            assert torch.allclose(final[name], expected_final[name], atol=1e-5), name


@pytest.fixture(scope="module")
def references(tiny_model_dir, tmp_path_factory):
    """Uninterrupted asynchronous runs, one per setting, side by side (one thread each)."""
    outs = {setting: tmp_path_factory.mktemp("async-reference") / setting for setting in SETTINGS}
    runs = [subprocess.Popen(_command(tiny_model_dir, out, setting, "--reward-sleep", "0.001"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                             start_new_session=True) for setting, out in outs.items()]
    try:
        for run in runs:
            _, stderr = run.communicate(timeout=240)
            assert run.returncode == 0, stderr[-3000:]
    finally:
        for run in runs:
            if run.poll() is None:
                kill_tree(run.pid)
    return outs


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_kill_9_at_a_random_moment_then_resume_is_exact(setting, tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    command = _command(tiny_model_dir, out, setting, "--save_strategy", "steps", "--save_steps", "1")
    delay, alive = kill_after_checkpoint(command + ["--reward-sleep", "0.1"], out, ENV, (0.0, 0.5))
    assert alive, f"the run finished before the kill ({delay:.3f} s after checkpoint-1)"
    where = f"killed {delay:.3f} s after checkpoint-1"
    result = run_tree(command + ["--reward-sleep", "0.001", "--resume"], 240, env=ENV)
    assert result.returncode == 0, f"{where}\n{result.stderr[-3000:]}"
    assert "Resumed from" in result.stderr, where
    _assert_same_run(out, references[setting])
    assert not list(out.glob(".checkpoint-*.tmp"))


def test_checkpoints_hold_the_batches_made_ahead(tmp_path, tiny_model_dir):
    """k = 2, mu = 2 (a batch serves 2 steps: S(b) = 2b), batch b made by the weights of step max(0, 2b - 2).
    After step 1 the producer has made batch 1 (initial weights; batch 2 waits for step 2's); after step 3, batch 2
    (step 2's weights). Step 1 and 3 end inside a batch, which is saved too (experience_0.pt)."""
    out = tmp_path / "out"
    result = run_tree(_command(tiny_model_dir, out, "k2_mu2_beta", "--save_strategy", "steps", "--save_steps", "1",
                               "--max_steps", "6"), 240, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    made = {step: [(m["index"], m["step"]) for m in torch.load(out / f"checkpoint-{step}" / "rollouts_0.pt",
                                                                 weights_only=False)["made"]] for step in (1, 3)}
    assert made == {1: [(1, 0)], 3: [(2, 2)]}
    assert (out / "checkpoint-1" / "experience_0.pt").is_file() and (out / "checkpoint-3" / "experience_0.pt").is_file()
    assert not (out / "checkpoint-5" / "rollouts_0.pt").exists()  # the run needs no batch after batch 2


def test_sigterm_stops_cleanly_and_resume_is_exact(tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    command = _command(tiny_model_dir, out, "k1")
    process = subprocess.Popen(command + ["--reward-sleep", "0.3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env=ENV, start_new_session=True)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().endswith("\n"),
                  process)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            kill_tree(process.pid)
    assert process.returncode == 0, stderr[-3000:]
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert 1 <= last < STEPS and [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{last}"]
    assert f"Stopped by signal {int(signal.SIGTERM)} after step {last}; checkpoint saved." in stderr
    resumed = run_tree(command + ["--reward-sleep", "0.001", "--resume"], 240, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(out, references["k1"])


def test_two_processes_match_one_process(tmp_path, tiny_model_dir):
    """Tools and dynamic sampling (groups move between processes) with k = 1, each process its own producer."""
    common = ["--max_steps", "4", "--beta", "0.05", "--max_staleness", "1", "--tools-every-turn", "1",
              "--max_completion_length", "24", "--max_tool_calling_iterations", "2", "--dynamic_sampling", "true",
              "--flat-even", "1"]
    one = run_tree([sys.executable, SCRIPT, tiny_model_dir, str(tmp_path / "one"), "--per_device_train_batch_size",
                    "16", *common], 240, env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_tree(_two_processes([sys.executable, SCRIPT, tiny_model_dir, str(tmp_path / "two"),
                                   "--per_device_train_batch_size", "8", *common]), 300, env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    rows_one, rows_two = read_jsonl(tmp_path / "one" / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert len(rows_one) == len(rows_two) == 4
    assert rows_one[0]["dynamic_sampling/dropped_groups"] > 0 and rows_one[0]["tools/call_frequency"] > 0
    assert [r["async/staleness/max"] for r in rows_two] == [0.0, 1.0, 1.0, 1.0]
    for a, b in zip(rows_one, rows_two):
        for key in ("reward", "tools/call_frequency", "completions/mean_length", "dynamic_sampling/rounds",
                    "dynamic_sampling/dropped_groups"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), key
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


def test_two_processes_kill_9_then_resume_is_exact(tmp_path, tiny_model_dir):
    """Launcher and both workers killed at a random moment after checkpoint-1; the resumed 2-process run ends at
    the uninterrupted 2-process run's metrics and weights."""
    base = ["--per_device_train_batch_size", "8", "--max_staleness", "1", "--max_steps", "5", "--save_strategy",
            "steps", "--save_steps", "1", "--completions_logging_steps", "1"]
    reference = tmp_path / "reference"
    done = run_tree(_two_processes([sys.executable, SCRIPT, tiny_model_dir, str(reference), *base,
                                    "--reward-sleep", "0.001"]), 300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    command = _two_processes([sys.executable, SCRIPT, tiny_model_dir, str(out), *base])
    kill_after_checkpoint(command + ["--reward-sleep", "0.2"], out, ENV, (0.0, 0.6), timeout=180)
    resumed = run_tree(command + ["--reward-sleep", "0.001", "--resume"], 300, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows, expected = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference / "metrics.jsonl")
    assert _comparable(rows) == _comparable(expected)
    from safetensors.torch import load_file

    final, expected_final = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert all(torch.equal(final[k], expected_final[k]) for k in expected_final)
    shutil.rmtree(reference)

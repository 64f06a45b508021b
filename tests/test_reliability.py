"""Reliability: exact resume after kill -9 (also mid-save), SIGTERM/SIGINT stops, save_total_limit, non-finite steps.

Training runs in a subprocess (tests/scripts/train_tiny.py, or `python -m grpokit.cli`) so that a real SIGKILL
or signal hits it. Every run is compared with an uninterrupted run of the same seed: on CPU a resumed run must
log exactly (==) the same numbers, except wall-clock timings.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpokit.train.learner_step as trainer_module
from grpokit.train.checkpointer import newest_checkpoint
from grpokit.config import GRPOConfig
from grpokit.observe.metrics import trim_jsonl
from grpokit.trainer import GRPOTrainer, NonFiniteError
from helpers import frac_a, read_jsonl
from procs import kill_after_checkpoint, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
TIMINGS = {"step_seconds", "tokens_per_second", "generation_seconds"}
STEPS = 8
# mu = 2 with a KL term (a buffered generation batch is saved in odd checkpoints), and plain on-policy GRPO
SETTINGS = {
    "mu2_beta": ["--num_iterations", "2", "--beta", "0.04"],
    "mu1": ["--loss_type", "grpo"],
    # multi-turn episodes: every turn calls a tool, whose result tokens are in the context but not the loss
    "tools": ["--tools-every-turn", "1", "--max_completion_length", "24", "--max_tool_calling_iterations", "2"],
}
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{SCRIPTS}")


def _train_command(model_dir, out, setting, *extra):
    return [sys.executable, str(SCRIPTS / "train_tiny.py"), model_dir, str(out), "--max_steps", str(STEPS),
            *SETTINGS[setting], *extra]


def _run(command, timeout=120):
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def _comparable(rows):
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


def _assert_same_run(out, reference_out):
    rows, expected = read_jsonl(out / "metrics.jsonl"), read_jsonl(reference_out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert _comparable(rows) == _comparable(expected)  # exact, every metric of every step
    assert read_jsonl(out / "completions.jsonl") == read_jsonl(reference_out / "completions.jsonl")
    from safetensors.torch import load_file

    final, expected_final = load_file(out / "model.safetensors"), load_file(reference_out / "model.safetensors")
    assert all(torch.equal(final[k], expected_final[k]) for k in expected_final)


def _logged_a_step(out):
    path = out / "metrics.jsonl"
    return path.is_file() and path.read_text().endswith("\n")  # a whole row, not one being written


@pytest.fixture(scope="module")
def references(tiny_model_dir, tmp_path_factory):
    """Uninterrupted runs, one per setting (the slow reward sleeps ~0 here: it changes no number)."""
    outs = {setting: tmp_path_factory.mktemp("reference") / setting for setting in SETTINGS}
    runs = [subprocess.Popen(_train_command(tiny_model_dir, out, setting, "--reward-sleep", "0.001"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
            for setting, out in outs.items()]  # side by side: one thread each
    for run in runs:
        _, stderr = run.communicate(timeout=120)
        assert run.returncode == 0, stderr[-3000:]
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_kill_9_at_a_random_moment_then_resume_is_exact(setting, tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    command = _train_command(tiny_model_dir, out, setting, "--save_strategy", "steps", "--save_steps", "1")
    delay, alive = kill_after_checkpoint(command + ["--reward-sleep", "0.1"], out, ENV, (0.0, 0.4), timeout=60)
    assert alive, f"the run finished before the kill ({delay:.3f} s after checkpoint-1)"
    newest = newest_checkpoint(out)  # the last step may be logged but not yet (completely) saved
    where = f"killed {delay:.3f} s after checkpoint-1, resumed from {newest.name}"
    result = _run(command + ["--reward-sleep", "0.001", "--resume"])
    assert result.returncode == 0, f"{where}\n{result.stderr[-3000:]}"
    assert f"Resumed from {newest} at step {newest.name.split('-')[1]}." in result.stderr, where
    _assert_same_run(out, references[setting])
    assert not list(out.glob(".checkpoint-*.tmp"))


@pytest.mark.slow
def test_kill_during_save_resumes_from_the_newest_complete_checkpoint(tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    base = _train_command(tiny_model_dir, out, "mu2_beta", "--reward-sleep", "0.001", "--save_strategy", "steps",
                          "--save_steps", "1")
    died = _run(base + ["--die-in-save", "3"])  # SIGKILL after staging checkpoint-3, before its rename
    assert died.returncode == -signal.SIGKILL
    staging = out / ".checkpoint-3.tmp"
    assert (staging / "trainer_state.json").is_file() and (staging / "experience_0.pt").is_file()
    assert not (out / "checkpoint-3").exists() and (out / "checkpoint-2" / "trainer_state.json").is_file()
    resumed = _run(base + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from {out / 'checkpoint-2'} at step 2." in resumed.stderr  # not the staged step 3
    assert not staging.exists()
    _assert_same_run(out, references["mu2_beta"])


@pytest.mark.slow
def test_sigterm_saves_the_last_finished_step_exits_0_and_resume_is_exact(tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    command = _train_command(tiny_model_dir, out, "mu1")  # save_strategy "no"
    process = subprocess.Popen(command + ["--reward-sleep", "0.3"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    wait_for(lambda: _logged_a_step(out), process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert 1 <= last < STEPS
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{last}"]
    assert f"Stopped by signal {int(signal.SIGTERM)} after step {last}; checkpoint saved." in stderr
    resumed = _run(command + ["--reward-sleep", "0.001", "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(out, references["mu1"])


@pytest.mark.slow
def test_cli_sigint_exits_0_and_grpo_train_resume_is_exact(tmp_path, tiny_model_dir, references):
    out = tmp_path / "out"
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(16)))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"model: {tiny_model_dir}\ndataset: {data}\nreward_funcs: ['helpers:short', 'slow_reward:slow']\n"
        f"output_dir: {out}\nmax_steps: {STEPS}\nloss_type: grpo\nnum_generations: 4\nmax_completion_length: 8\n"
        "learning_rate: 0.01\ndisable_tqdm: true\nseed: 0\nlogging_steps: 1\n"
    )
    command = [sys.executable, "-m", "grpokit.cli", "train", str(config)]
    env = dict(ENV, SLOW_REWARD_SECONDS="0.3")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_for(lambda: _logged_a_step(out), process)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-3000:]
    last = read_jsonl(out / "metrics.jsonl")[-1]["step"]
    assert (out / f"checkpoint-{last}" / "trainer_state.json").is_file()
    resumed = subprocess.run(command + ["--resume"], capture_output=True, text=True, timeout=120, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(out, references["mu1"])


# ---------------------------------------------------------------- in-process


def _config(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=4, learning_rate=1e-2, disable_tqdm=True, seed=0, logging_steps=1)
    values.update(overrides)
    return GRPOConfig(**values)


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "lo')  # killed mid-append
    trim_jsonl(path, 2)
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]


def test_save_total_limit_keeps_the_newest(tmp_path, tiny_model_dir, prompt_dataset):
    args = _config(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2)
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def _nan_loss_on(monkeypatch, steps):
    """Make policy_loss return NaN while the trainer works on the given optimizer steps (1-based)."""
    original = trainer_module.policy_loss
    state = {}

    def poisoned(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        if state["trainer"].state.global_step + 1 in steps:
            loss = loss * float("nan")
        return loss, metrics

    monkeypatch.setattr(trainer_module, "policy_loss", poisoned)
    return state


def _snapshot_each_step(monkeypatch, trainer):
    snapshots = []
    original = trainer.learner.step

    def recorded(exp, *args):
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        lr = trainer.scheduler.get_last_lr()[0]
        out = original(exp, *args)
        snapshots.append((before, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, lr))
        return out

    monkeypatch.setattr(trainer.learner, "step", recorded)
    return snapshots


def test_a_nonfinite_step_is_skipped_and_counted(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    state = _nan_loss_on(monkeypatch, {2})
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], _config(tmp_path, lr_scheduler_type="linear"), prompt_dataset)
    state["trainer"] = trainer
    snapshots = _snapshot_each_step(monkeypatch, trainer)
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in rows] == [0, 1, 0]
    assert [r["nonfinite_skips"] for r in rows] == [0, 1, 1]
    assert rows[1]["loss"] != rows[1]["loss"]  # the NaN is logged as it was
    before, after, _ = snapshots[1]
    assert all(torch.equal(before[n], after[n]) for n in before)  # the skipped step changed nothing
    assert all(p.grad is None for p in trainer.model.parameters())
    assert rows[1]["learning_rate"] == rows[0]["learning_rate"]  # the schedule did not advance either
    before, after, _ = snapshots[2]
    assert any(not torch.equal(before[n], after[n]) for n in before)  # training goes on
    assert trainer.state.nonfinite_skips == 1 and trainer.state.consecutive_nonfinite_steps == 0


def test_consecutive_nonfinite_steps_stop_with_a_clear_error(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    state = _nan_loss_on(monkeypatch, {2, 3, 4})
    args = _config(tmp_path, max_steps=6, max_consecutive_nonfinite_steps=3)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    state["trainer"] = trainer
    with pytest.raises(NonFiniteError, match=r"NaN/inf in 3 optimizer steps in a row \(up to step 4") as err:
        trainer.train()
    assert "Lower learning_rate" in str(err.value) and "max_consecutive_nonfinite_steps" in str(err.value)
    assert [r["nonfinite_skips"] for r in read_jsonl(tmp_path / "out" / "metrics.jsonl")] == [0, 1, 2]

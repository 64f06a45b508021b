"""Damaged checkpoints are named before a resume reads them (and --resume can fall back to the newest that
verifies); a failed final save leaves the previous model files and names the path and the free space."""

import errno
import json

import pytest

from grpokit.train.checkpointer import CheckpointError
from grpokit.trainer import GRPOTrainer, SaveError
from helpers import frac_a
from test_trainer import config


@pytest.fixture
def run(tmp_path, tiny_model_dir, prompt_dataset):
    """A finished 4-step run with checkpoints at steps 2 and 4."""
    args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset).train()
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    return out


def resume(tmp_path, tiny_model_dir, prompt_dataset, target=True, **options):
    args = config(tmp_path, max_steps=6, save_strategy="steps", save_steps=2, **options)
    return GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset).train(resume_from_checkpoint=target)


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda c: flip_a_byte(c / "model.safetensors"), "model.safetensors changed since it was saved"),
    (lambda c: (c / "optimizer.pt").write_bytes((c / "optimizer.pt").read_bytes()[:100]),
     r"optimizer.pt has 100 bytes, \d+ were saved"),
    (lambda c: (c / "rng_state_0.pt").unlink(), "rng_state_0.pt is missing"),
    (lambda c: (c / "trainer_state.json").write_text("{not json"), "trainer_state.json cannot be read: JSONDecodeError"),
], ids=["flipped_byte", "truncated", "missing", "state_not_json"])
def test_a_damaged_checkpoint_is_named_with_the_newest_that_verifies(
        run, tmp_path, tiny_model_dir, prompt_dataset, damage, message):
    damage(run / "checkpoint-4")
    with pytest.raises(CheckpointError, match=message) as err:
        resume(tmp_path, tiny_model_dir, prompt_dataset)
    assert f"The newest older checkpoint that verifies is {run / 'checkpoint-2'}" in str(err.value)


def test_resume_fallback_picks_the_newest_checkpoint_that_verifies(
        run, tmp_path, tiny_model_dir, prompt_dataset, caplog):
    flip_a_byte(run / "checkpoint-4" / "model.safetensors")
    state = resume(tmp_path, tiny_model_dir, prompt_dataset, resume_fallback=True)
    assert "Skipping" in caplog.text and "checkpoint-2, the newest older checkpoint" in caplog.text
    assert state.global_step == 6
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # steps 3-4 were trained again from checkpoint-2, their rows replaced


def test_a_named_damaged_checkpoint_is_not_replaced_even_with_fallback(run, tmp_path, tiny_model_dir, prompt_dataset):
    flip_a_byte(run / "checkpoint-4" / "optimizer.pt")
    with pytest.raises(CheckpointError, match="optimizer.pt changed"):
        resume(tmp_path, tiny_model_dir, prompt_dataset, target=str(run / "checkpoint-4"), resume_fallback=True)


def test_no_checkpoint_that_verifies_says_so(run, tmp_path, tiny_model_dir, prompt_dataset):
    for step in (2, 4):
        flip_a_byte(run / f"checkpoint-{step}" / "model.safetensors")
    with pytest.raises(CheckpointError, match="No older checkpoint verifies"):
        resume(tmp_path, tiny_model_dir, prompt_dataset, resume_fallback=True)


def test_a_failed_final_save_keeps_the_previous_model_and_names_the_path(
        run, tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json")}
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=6, save_strategy="steps", save_steps=2),
                          prompt_dataset)
    real = trainer._write_model

    def disk_full(folder):
        real(folder)  # written in full, then the disk fills on the last file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trainer, "_write_model", disk_full)
    with pytest.raises(SaveError, match=rf"Saving the model to {run} failed: .*No space left on device \(.* GiB free"):
        trainer.save_model(str(run))
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.suffix in (".safetensors", ".json")}
    assert after == before and not list(run.glob(".*staging"))


def test_grpo_train_resume_reports_the_damage(run, tmp_path, tiny_model_dir, capsys):
    from grpokit.cli import main

    flip_a_byte(run / "checkpoint-4" / "model.safetensors")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(12)))
    recipe = tmp_path / "run.yaml"
    recipe.write_text(f"model: {tiny_model_dir}\ndataset: {data}\nreward_funcs: [format]\noutput_dir: {run}\n"
                      "max_steps: 6\nnum_generations: 4\nper_device_train_batch_size: 8\nmax_completion_length: 8\n")
    assert main(["train", str(recipe), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "Cannot resume from" in err and "model.safetensors changed since it was saved" in err
    assert "--resume_fallback true" in err

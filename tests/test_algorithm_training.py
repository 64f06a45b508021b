"""The algorithm options inside real training runs: every variant through `grpo train` on the demo task, dynamic
sampling (drops, cost, fill, exact resume), the KL in the reward, reference sync, adaptive entropy, step rewards
and evaluation's None."""

import math
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from safetensors.torch import load_file

from grpokit.cli import main
from grpokit.config import GRPOConfig
from grpokit.rewards import StepReward
from grpokit.trainer import GRPOTrainer
from helpers import frac_a, read_jsonl

ROOT = Path(__file__).resolve().parent.parent

VARIANTS = {
    "cispo": ["--loss_type", "cispo", "--epsilon_high", "5.0"],
    "sapo": ["--loss_type", "sapo"],
    "luspo": ["--loss_type", "luspo", "--importance_sampling_level", "sequence"],
    "vespo": ["--loss_type", "vespo"],
    "gmpo": ["--loss_type", "gmpo", "--epsilon", "0.4"],
    "gspo_token": ["--importance_sampling_level", "sequence_token"],
    "sapo_with_dr_grpo": ["--loss_type", "dr_grpo", "--policy_objective", "sapo", "--scale_rewards", "none"],
    "off_policy_mask": ["--off_policy_mask_threshold", "0.5", "--num_iterations", "2"],
    "rloo": ["--advantage_estimator", "rloo"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_plus_plus_baseline"],
    "k1": ["--kl_estimator", "k1"],
    "k2_bias_correction": ["--kl_estimator", "k2", "--use_bias_correction_kl", "true"],
    "k3_plus": ["--kl_estimator", "k3+"],
    "kl_in_reward": ["--kl_in_reward", "true"],
    "entropy": ["--top_entropy_quantile", "0.2", "--entropy_coef", "0.01"],
    "adaptive_entropy": ["--use_adaptive_entropy", "true", "--entropy_target", "10"],
    "sync_ref": ["--sync_ref_model", "true", "--ref_model_sync_steps", "1"],
    "dynamic_sampling": ["--dynamic_sampling", "true"],
}


@pytest.fixture(scope="module")
def demo_yaml(tmp_path_factory):
    """examples/demo.yaml without its eval split, paths made absolute, a small batch."""
    config = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    config.pop("eval_dataset")
    config["model"] = str(ROOT / config["model"])
    config["dataset"] = str(ROOT / config["dataset"])
    config.update(per_device_train_batch_size=16, max_steps=3, disable_tqdm=True)
    path = tmp_path_factory.mktemp("variants") / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_trains_the_demo_task_through_grpo_train(variant, demo_yaml, tmp_path):
    out = tmp_path / variant
    assert main(["train", str(demo_yaml), "--output_dir", str(out), *VARIANTS[variant]]) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert (out / "model.safetensors").is_file()
    if variant == "kl_in_reward":
        assert "kl" not in rows[0] and rows[-1]["rewards/kl_penalty/mean"] <= 0.0
    if variant == "entropy":
        assert all(0.0 < r["entropy_mask_fraction"] <= 0.5 for r in rows)
    if variant == "adaptive_entropy":  # entropy far below the target: the coefficient climbs by delta per step
        assert [r["entropy_coef"] for r in rows] == pytest.approx([0.005, 0.01, 0.015], abs=1e-12)


# --------------------------------------------------------------------------- dynamic sampling
def _flat_or_frac_a(prompts, completions, flat, **kwargs):
    """1.0 for every completion of a 'flat' prompt (a group with no signal), the text length otherwise."""
    return [1.0 if f else float(len(text)) for f, text in zip(flat, completions)]


def _dataset(flat_every=2, rows=16):
    return datasets.Dataset.from_list(
        [{"prompt": f"{i}+{i}=", "flat": i % flat_every == 0} for i in range(rows)]
    )


def _config(tmp_path, name="out", **overrides):
    values = dict(
        output_dir=str(tmp_path / name), max_steps=3, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=8, learning_rate=1e-2, disable_tqdm=True, seed=0, log_completions=True,
        completions_logging_steps=1, logging_steps=1,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def test_dynamic_sampling_trains_only_on_groups_with_signal(tmp_path, tiny_model_dir):
    trainer = GRPOTrainer(tiny_model_dir, [_flat_or_frac_a], _config(tmp_path, dynamic_sampling=True), _dataset())
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    completions = read_jsonl(tmp_path / "out" / "completions.jsonl")
    flat_prompts = {f"{i}+{i}=" for i in range(0, 16, 2)}
    assert completions and not any(c["prompt"] in flat_prompts for c in completions)  # every kept group has signal
    for r in rows:  # half the prompts are flat: each batch of 2 groups needs about 2 rounds
        assert r["dynamic_sampling/rounds"] >= 2
        assert r["dynamic_sampling/extra_completions"] == (r["dynamic_sampling/rounds"] - 1) * 8
        assert r["dynamic_sampling/dropped_groups"] >= 1 and r["dynamic_sampling/filled_with_flat"] == 0
        assert r["frac_reward_zero_std"] == 0.0


def test_dynamic_sampling_fills_with_flat_groups_after_max_rounds(tmp_path, tiny_model_dir, caplog):
    def constant(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    args = _config(tmp_path, dynamic_sampling=True, dynamic_sampling_max_rounds=3, max_steps=1)
    with caplog.at_level("WARNING", logger="grpokit"):
        GRPOTrainer(tiny_model_dir, [constant], args, _dataset()).train()
    (row,) = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert row["dynamic_sampling/rounds"] == 3 and row["dynamic_sampling/filled_with_flat"] == 2
    assert row["dynamic_sampling/dropped_groups"] == 4 and row["dynamic_sampling/extra_completions"] == 16
    assert "dynamic_sampling_max_rounds" in caplog.text


def _weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def test_dynamic_sampling_is_deterministic_and_exact_on_resume(tmp_path, tiny_model_dir):
    straight = _config(tmp_path, "straight", dynamic_sampling=True, max_steps=4, lr_scheduler_type="constant")
    GRPOTrainer(tiny_model_dir, [_flat_or_frac_a], straight, _dataset()).train()
    first = _config(tmp_path, "resumed", dynamic_sampling=True, max_steps=2, save_strategy="steps", save_steps=2,
                    lr_scheduler_type="constant")
    GRPOTrainer(tiny_model_dir, [_flat_or_frac_a], first, _dataset()).train()
    second = _config(tmp_path, "resumed", dynamic_sampling=True, max_steps=4, save_strategy="steps", save_steps=2,
                     lr_scheduler_type="constant")
    GRPOTrainer(tiny_model_dir, [_flat_or_frac_a], second, _dataset()).train(resume_from_checkpoint=True)
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows_a = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    rows_b = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    keys = ("reward", "loss", "dynamic_sampling/rounds", "dynamic_sampling/dropped_groups")
    assert [[r[k] for k in keys] for r in rows_a] == [[r[k] for k in keys] for r in rows_b]


# --------------------------------------------------------------------------- KL in the reward, reference sync
def test_kl_in_reward_moves_advantages_when_rewards_are_flat(tmp_path, tiny_model_dir):
    args = _config(tmp_path, beta=0.5, kl_in_reward=True, max_steps=3)
    GRPOTrainer(tiny_model_dir, [_flat_or_frac_a], args, _dataset()).train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert rows[0]["rewards/kl_penalty/mean"] == 0.0  # step 1: the policy is the reference
    assert rows[-1]["rewards/kl_penalty/mean"] < 0.0
    assert "kl" not in rows[0]  # the KL left the loss
    flat_prompts = {f"{i}+{i}=" for i in range(0, 16, 2)}
    late_flat = [c for c in read_jsonl(tmp_path / "out" / "completions.jsonl")
                 if c["step"] == 3 and c["prompt"] in flat_prompts]
    # their reward is the same 1.0: only the KL penalty tells the completions apart
    assert late_flat and any(c["advantage"] != 0.0 for c in late_flat)


def test_reference_sync_mixes_the_policy_in_and_survives_resume(tmp_path, tiny_model_dir, prompt_dataset):
    args = _config(tmp_path, beta=0.04, sync_ref_model=True, ref_model_sync_steps=2, ref_model_mixup_alpha=0.25,
                   max_steps=2, save_strategy="steps", save_steps=2)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    start = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    policy = dict(trainer.unwrapped.named_parameters())
    for name, param in trainer.ref_model.named_parameters():
        expected = 0.25 * policy[name].detach() + 0.75 * start[name]
        assert torch.allclose(param, expected, atol=1e-7), name
    saved = load_file(str(tmp_path / "out" / "checkpoint-2" / "reference.safetensors"))
    resumed = GRPOTrainer(tiny_model_dir, [frac_a], _config(tmp_path, beta=0.04, sync_ref_model=True, max_steps=3),
                          prompt_dataset)
    resumed.checkpointer.load(tmp_path / "out" / "checkpoint-2", resumed.checkpoint_parts())
    for name, param in resumed.ref_model.named_parameters():
        if name in saved:
            assert torch.equal(param, saved[name]), name
    model = load_file(str(tmp_path / "out" / "checkpoint-2" / "model.safetensors"))
    for name, param in resumed.unwrapped.named_parameters():  # the policy's own weights, not the reference's
        assert torch.equal(param, model[name]), name


def test_adaptive_entropy_coefficient_is_checkpointed(tmp_path, tiny_model_dir, prompt_dataset):
    args = _config(tmp_path, use_adaptive_entropy=True, entropy_target=0.0, entropy_coef=0.05, max_steps=2,
                   save_strategy="steps", save_steps=2)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["entropy_coef"] for r in rows] == pytest.approx([0.045, 0.04], abs=1e-12)  # above target: down
    resumed = GRPOTrainer(tiny_model_dir, [frac_a], _config(tmp_path, use_adaptive_entropy=True, max_steps=3),
                          prompt_dataset)
    resumed.checkpointer.load(tmp_path / "out" / "checkpoint-2", resumed.checkpoint_parts())
    assert resumed.state.entropy_coef == pytest.approx(0.04, abs=1e-12)
    assert resumed.state.last_entropy == pytest.approx(trainer.state.last_entropy, abs=1e-12)


# --------------------------------------------------------------------------- step rewards, evaluation
def test_step_rewards_give_per_token_advantages_in_training(tmp_path, tiny_model_dir, prompt_dataset):
    def score_step(step_text, prompt, **kwargs):
        return float(step_text.count("a"))

    steps = StepReward(score_step, by=r"\d", name="a_steps")  # a digit ends a step
    trainer = GRPOTrainer(tiny_model_dir, [frac_a, steps], _config(tmp_path, max_steps=2), prompt_dataset)
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert "rewards/a_steps/step_mean" in rows[0] and "rewards/frac_a/mean" in rows[0]
    exp, _ = trainer.learner.prepare(trainer.pipeline.next(trainer.state), trainer.collector.advantages)
    assert exp.advantages.dim() == 2 and exp.advantages.shape == exp.completion_ids.shape


def test_evaluation_reads_none_as_not_applicable(tmp_path, tiny_model_dir, prompt_dataset):
    def half(prompts, completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    trainer = GRPOTrainer(tiny_model_dir, [half], _config(tmp_path, max_steps=1), prompt_dataset, prompt_dataset)
    result = trainer.evaluate()
    assert result["eval/reward"] == 1.0  # unscored completions are left out, not counted as 0
    assert result["eval/rewards/half/mean"] == 1.0

"""End-to-end GRPOTrainer on a tiny model built in the tests (no hub)."""

import math

import datasets
import pytest
import torch
from transformers import AutoModelForCausalLM

import grpokit.rollout.local as local_module
import grpokit.train.learner as trainer_module
from grpokit.rollout.local import LocalEngine
from grpokit.config import ConfigError, GRPOConfig
from grpokit.trainer import GRPOTrainer
from helpers import frac_a, read_jsonl, short

REQUIRED_KEYS = {
    "step", "reward", "reward_std", "rewards/frac_a/mean", "rewards/frac_a/std", "frac_reward_zero_std", "kl",
    "loss", "grad_norm", "learning_rate", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
    "entropy", "completions/mean_length", "completions/min_length", "completions/max_length",
    "completions/clipped_ratio", "tokens_per_second", "step_seconds",
}


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=8, learning_rate=1e-2, disable_tqdm=True, seed=0, logging_steps=1,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def test_training_moves_parameters_and_logs_every_metric(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, beta=0.04), prompt_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert REQUIRED_KEYS <= set(rows[0])
    assert all(math.isfinite(r["loss"]) and r["kl"] >= 0 for r in rows)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    for name, param in saved.named_parameters():
        assert torch.equal(param, dict(trainer.model.named_parameters())[name])
    completions = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert len(completions) == 8 and set(completions[0]) == {"step", "prompt", "completion", "rewards", "advantage"}


def test_beta_zero_loads_no_reference_model(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("reference model loaded with beta = 0")

    monkeypatch.setattr(trainer_module, "reference_model", forbidden)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, beta=0.0, max_steps=1), prompt_dataset)
    trainer.train()
    assert trainer.ref_model is None
    assert "kl" not in read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]


def test_reference_model_is_frozen_copy(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, beta=0.1, max_steps=2), prompt_dataset)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    for name, param in trainer.ref_model.named_parameters():
        assert not param.requires_grad and torch.equal(param, start[name])


def _count_calls(monkeypatch, trainer, name):
    calls = []
    original = getattr(trainer, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(trainer, name, counted)
    return calls


def test_num_iterations_reuses_each_generation(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    generations = []
    original = LocalEngine.generate
    monkeypatch.setattr(LocalEngine, "generate", lambda *a, **k: generations.append(1) or original(*a, **k))
    trainer = GRPOTrainer(tiny_model_dir, [short], config(tmp_path, num_iterations=2, max_steps=4), prompt_dataset)
    logprob_passes = _count_calls(monkeypatch, trainer.learner, "batched_logprobs")
    trainer.train()
    assert len(generations) == 2  # 4 optimizer steps, 2 per generation
    assert len(logprob_passes) == 2  # old log-probs once per generation, no reference pass (beta = 0)
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["reward"] == rows[3]["reward"]
    assert rows[0]["frac_reward_zero_std"] < 1  # there is a learning signal
    assert rows[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # first pass: policy = old policy
    assert rows[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)  # second pass is off-policy


def test_on_policy_skips_old_logprobs(tmp_path, tiny_model_dir, prompt_dataset, monkeypatch):
    trainer = GRPOTrainer(
        tiny_model_dir, [frac_a], config(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=2),
        prompt_dataset,
    )
    passes = _count_calls(monkeypatch, trainer.learner, "batched_logprobs")
    trainer.train()
    assert passes == []


def test_reward_favouring_a_token_raises_its_frequency(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=40, learning_rate=2e-2, max_completion_length=8)
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    first, last = (sum(r["reward"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert first < 0.1  # 'a' is one of 98 characters
    assert last > 0.5


def test_columns_completion_ids_and_state_reach_rewards(tmp_path, tiny_model_dir, prompt_dataset):
    seen = {}

    def spy(prompts, completions, answer, task, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, answer=answer, task=task, ids=completion_ids, step=trainer_state.global_step)
        return [1.0 if t == "math" else None for t in task]

    GRPOTrainer(tiny_model_dir, [spy], config(tmp_path, max_steps=1), prompt_dataset).train()
    assert len(seen["prompts"]) == 8 and seen["prompts"][0] == seen["prompts"][3]
    assert all(str(2 * int(p.split("+")[0])) == a for p, a in zip(seen["prompts"], seen["answer"]))
    assert all(isinstance(ids, list) and 1 <= len(ids) <= 8 for ids in seen["ids"])
    assert seen["step"] == 0


def test_conversational_prompts_use_the_chat_template(tmp_path, tiny_model_dir):
    rows = [{"prompt": [{"role": "user", "content": f"say {c}"}]} for c in "abcd"]
    seen = []

    def spy(prompts, completions, **kwargs):
        seen.append(completions[0])
        return [0.0] * len(completions)

    trainer = GRPOTrainer(tiny_model_dir, [spy], config(tmp_path, max_steps=1), datasets.Dataset.from_list(rows))
    assert trainer.tokenizer.decode(trainer.prompt_ids[0]) == "user: say a\nassistant: "
    trainer.train()
    assert seen[0][0]["role"] == "assistant" and isinstance(seen[0][0]["content"], str)


def test_generation_kwargs_pass_through_and_truncation_mask(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=1, generation_kwargs={"min_new_tokens": 8}, mask_truncated_completions=True)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    trainer.train()
    row = read_jsonl(tmp_path / "out" / "metrics.jsonl")[0]
    assert row["completions/min_length"] == 8 and row["completions/clipped_ratio"] > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_every_completion_truncated_and_masked_is_a_zero_step(tmp_path, tiny_model_dir, prompt_dataset, loss_type):
    args = config(tmp_path, max_steps=2, generation_kwargs={"min_new_tokens": 8}, mask_truncated_completions=True,
                  loss_type=loss_type, beta=0.04)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    state = trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["completions/clipped_ratio"] for r in rows] == [1.0, 1.0]
    assert [r["loss"] for r in rows] == [0.0, 0.0] and state.nonfinite_skips == 0
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_eos_masks_the_rest_of_the_completion():
    from grpokit.rollout.generate import mask_after_eos

    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 2, 3, 4]])
    mask, truncated = mask_after_eos(ids, [1])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert truncated.tolist() == [False, True, False]


def test_model_object_and_tokenizer_object(tmp_path, prompt_dataset):
    from grpokit.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=1)
    trainer = GRPOTrainer(model, [frac_a], config(tmp_path, max_steps=1, beta=0.1), prompt_dataset,
                          processing_class=tokenizer)
    trainer.train()
    assert trainer.ref_model is not model


def test_peft_lora_trains_only_adapters(tmp_path, tiny_model_dir, prompt_dataset):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(tiny_model_dir, [short], config(tmp_path, max_steps=3, beta=0.1), prompt_dataset,
                          peft_config=lora)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora" not in n}
    lora_start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(params[n], p) for n, p in base.items())
    assert any(not torch.equal(params[n], p) for n, p in lora_start.items())
    assert trainer.ref_model is None  # the reference is the base model with adapters off
    kls = [row["kl"] for row in read_jsonl(tmp_path / "out" / "metrics.jsonl")]
    assert kls[0] == 0.0 and kls[-1] > 0  # the adapters start as the identity, then move away from the base


def test_gradient_checkpointing_gives_the_same_step(tmp_path, tiny_model_dir, prompt_dataset):
    results = []
    for flag in (False, True):
        args = config(tmp_path / str(flag), max_steps=2, gradient_checkpointing=flag)
        GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
        results.append(read_jsonl(tmp_path / str(flag) / "out" / "metrics.jsonl"))
    for plain, checkpointed in zip(*results):
        assert checkpointed["loss"] == pytest.approx(plain["loss"], abs=1e-6)
        assert checkpointed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def test_same_seed_same_run_and_seed_changes_samples(tmp_path, tiny_model_dir, prompt_dataset):
    def run(name, seed):
        GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path / name, seed=seed), prompt_dataset).train()
        return read_jsonl(tmp_path / name / "out" / "completions.jsonl")

    first, again, other = run("a", 0), run("b", 0), run("c", 1)
    assert [r["completion"] for r in first] == [r["completion"] for r in again]
    assert [r["completion"] for r in first] != [r["completion"] for r in other]


def test_refuses_output_dir_with_checkpoints_unless_resume_or_overwrite(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
    args.overwrite_output_dir = True
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()


def test_bf16_runs_rollout_and_passes_under_autocast_with_fp32_weights(tmp_path, tiny_model_dir, prompt_dataset,
                                                                       monkeypatch):
    seen = {}
    generate = local_module.generate_completions

    def spy(*args, **kwargs):
        seen["rollout_autocast"] = torch.is_autocast_enabled("cpu")
        return generate(*args, **kwargs)

    monkeypatch.setattr(local_module, "generate_completions", spy)
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], config(tmp_path, max_steps=2, bf16=True, beta=0.04), prompt_dataset)
    before = [p.detach().clone() for p in trainer.unwrapped.parameters()]
    trainer.train()
    assert seen["rollout_autocast"]
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert all(math.isfinite(r[k]) for r in rows for k in ("loss", "kl", "grad_norm", "entropy"))
    after = list(trainer.unwrapped.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before))
    exp_avg = next(iter(trainer.optimizer.state.values()))["exp_avg"]
    assert exp_avg.dtype == torch.float32

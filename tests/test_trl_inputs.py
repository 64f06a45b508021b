"""What TRL's GRPOTrainer accepts beyond a Dataset and reward callables: streaming and named eval datasets, a
PeftModel, reward-model objects with reward_processing_classes, the log_extra / log_metric reward arguments, no
reward functions, callbacks, custom optimizers, get_high_entropy_mask, and generation_kwargs holding do_sample."""

from pathlib import Path

import datasets
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification, TrainerCallback, set_seed

from grpokit.config import ConfigError
from grpokit.data import DataError
from grpokit.rewards import RewardError
from grpokit.trainer import GRPOTrainer
from helpers import frac_a, read_jsonl
from test_trainer import config


def losses(state):
    return [row["loss"] for row in state.log_history if "loss" in row]


# ------------------------------------------------------------------ datasets
def test_a_streaming_dataset_trains_as_the_rows_it_yields(tmp_path, tiny_model_dir, prompt_dataset):
    # max_steps 3 x 2 prompts per generation batch (8 completions / G 4) = 6 prompts read from the stream
    rows = prompt_dataset.select(range(6))
    stream = datasets.IterableDataset.from_generator(lambda: iter(prompt_dataset.to_list()))
    streamed = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "a"), train_dataset=stream).train()
    plain = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "b"), train_dataset=rows).train()
    assert losses(streamed) == losses(plain) and len(losses(plain)) == 3


def test_a_streaming_dataset_needs_max_steps(tmp_path, tiny_model_dir, prompt_dataset):
    stream = prompt_dataset.to_iterable_dataset()
    with pytest.raises(ConfigError, match="IterableDataset.*set max_steps"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=-1), train_dataset=stream)


def test_named_eval_sets_are_each_evaluated_as_alone(tmp_path, tiny_model_dir, prompt_dataset):
    easy, hard = prompt_dataset.select(range(3)), prompt_dataset.select(range(3, 5))
    args = config(tmp_path / "a", max_steps=1)
    both = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset,
                       eval_dataset=datasets.DatasetDict(easy=easy, hard=hard.to_iterable_dataset()))
    result = both.evaluate()
    alone = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "b", max_steps=1), prompt_dataset,
                        eval_dataset=hard)
    assert result["eval/hard/reward"] == alone.evaluate()["eval/reward"]
    assert result["eval/easy/reward"] == alone.evaluate(easy)["eval/reward"]
    assert "eval/reward" not in result and "eval/easy/rewards/frac_a/mean" in result
    state = both.train()
    evaluated = [row for row in state.log_history if "eval/easy/reward" in row]
    assert [row["step"] for row in evaluated] == [0, 1] and "eval/hard/reward" in evaluated[1]  # evaluate(), then the end


@pytest.mark.parametrize("name", ["reward", "a/b", ""])
def test_eval_set_names_that_would_clash_are_refused(tmp_path, tiny_model_dir, prompt_dataset, name):
    with pytest.raises(DataError, match="eval set name"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), prompt_dataset, eval_dataset={name: prompt_dataset})


# ------------------------------------------------------------------ models
def test_a_peft_model_trains_its_adapter_as_peft_config_does(tmp_path, tiny_model_dir, prompt_dataset):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    via_config = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "a", beta=0.04), prompt_dataset,
                             peft_config=lora).train()
    set_seed(0)  # the trainer seeds before wrapping, so the adapter starts from the same weights
    wrapped = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    base = {n: p.detach().clone() for n, p in wrapped.named_parameters() if "lora_" not in n}
    trainer = GRPOTrainer(wrapped, frac_a, config(tmp_path / "b", beta=0.04), prompt_dataset)
    assert isinstance(trainer.unwrapped, PeftModel) and trainer.ref_model is None  # the adapter switched off
    state = trainer.train()
    assert losses(state) == pytest.approx(losses(via_config), rel=1e-6)
    assert all(torch.equal(p, base[n]) for n, p in wrapped.named_parameters() if n in base)
    with pytest.raises(ConfigError, match="already a PeftModel"):
        GRPOTrainer(wrapped, frac_a, config(tmp_path / "c"), prompt_dataset, peft_config=lora)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_model_dir):
    from grpokit.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    torch.manual_seed(3)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id))
    path = tmp_path_factory.mktemp("reward-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_a_reward_model_object_with_its_processing_class_scores_as_its_folder(
        tmp_path, tiny_model_dir, prompt_dataset, reward_model_dir):
    from grpokit.models.loading import load_tokenizer

    by_path = GRPOTrainer(tiny_model_dir, reward_model_dir, config(tmp_path / "a", max_steps=1), prompt_dataset)
    model = Qwen2ForSequenceClassification.from_pretrained(reward_model_dir)
    by_object = GRPOTrainer(tiny_model_dir, [model], config(tmp_path / "b", max_steps=1), prompt_dataset,
                            reward_processing_classes=[load_tokenizer(reward_model_dir)])
    assert by_object.reward_funcs[0].fn.model is model
    first, second = by_path.train().log_history[0], by_object.train().log_history[0]
    assert first["reward"] == second["reward"] and first["reward_std"] > 0
    assert by_object.reward_processing_classes == [by_object.reward_funcs[0].fn.tokenizer]
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries.*must match"):
        GRPOTrainer(tiny_model_dir, [model], config(tmp_path / "c"), prompt_dataset,
                    reward_processing_classes=[None, None])


# ------------------------------------------------------------------ rewards
def test_reward_functions_log_metrics_and_completion_columns(tmp_path, tiny_model_dir, prompt_dataset):
    seen = []

    def logging_reward(prompts, completions, log_extra, log_metric, **kwargs):
        values = frac_a(prompts, completions)
        seen.append(sum(values) / len(values))
        log_metric("mean_frac_a", seen[-1])
        log_extra("length", [len(c) for c in completions])
        return values

    args = config(tmp_path, max_steps=2, log_completions=True, completions_logging_steps=1)
    state = GRPOTrainer(tiny_model_dir, logging_reward, args, prompt_dataset).train()
    assert [row["mean_frac_a"] for row in state.log_history[:2]] == pytest.approx(seen)
    completions = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert len(completions) == 16 and all(row["length"] == len(row["completion"]) for row in completions)


def test_a_logged_metric_may_not_shadow_the_trainers(tmp_path, tiny_model_dir, prompt_dataset):
    def shadowing(completions, log_metric, **kwargs):
        log_metric("reward", 1.0)
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="'reward' is a metric the trainer logs itself"):
        GRPOTrainer(tiny_model_dir, shadowing, config(tmp_path, max_steps=1), prompt_dataset).train()


@pytest.mark.parametrize("reward_funcs", [None, []])
def test_no_reward_source_is_refused_as_trl_does(tmp_path, tiny_model_dir, prompt_dataset, reward_funcs):
    with pytest.raises(ConfigError, match="No reward source provided"):
        GRPOTrainer(tiny_model_dir, reward_funcs, config(tmp_path), prompt_dataset)


def test_a_missing_train_dataset_is_named(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match="`train_dataset` is required"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path))


# ------------------------------------------------------------------ callbacks and optimizers
class Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.events.append(("train_begin", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", logs["step"]))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))
        control.should_save = state.global_step == 1
        control.should_training_stop = state.global_step == 2

    def on_save(self, args, state, control, **kwargs):
        self.events.append(("save", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.events.append(("evaluate", metrics["step"]))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.events.append(("train_end", state.global_step, model is not None))


def test_callbacks_see_every_event_and_can_save_and_stop(tmp_path, tiny_model_dir, prompt_dataset):
    recorder = Recorder()
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=5), prompt_dataset,
                          eval_dataset=prompt_dataset.select(range(2)), callbacks=[recorder])
    state = trainer.train()
    assert recorder.events == [
        ("train_begin", 0), ("log", 1), ("step_end", 1), ("save", 1), ("log", 2), ("step_end", 2),
        ("evaluate", 2), ("log", 2), ("train_end", 2, True),  # the second ("log", 2): TRL's closing row
    ]
    assert state.global_step == 2 and state.interrupted is None
    assert (tmp_path / "out" / "checkpoint-1").is_dir() and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_callback_that_is_not_one_is_refused(tmp_path, tiny_model_dir, prompt_dataset):
    with pytest.raises(TypeError, match="none of the callback methods"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), prompt_dataset, callbacks=[object()])
    with pytest.raises(TypeError, match="none of the callback methods"):  # before any model or tokenizer loads
        GRPOTrainer(str(tmp_path / "no-such-model"), frac_a, config(tmp_path), prompt_dataset, callbacks=[object()])


def test_a_given_optimizer_and_schedule_are_used(tmp_path, tiny_model_dir, prompt_dataset):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=0.5)
    constant = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 0.1)
    trainer = GRPOTrainer(model, frac_a, config(tmp_path, max_steps=1, beta=0.0), prompt_dataset,
                          optimizers=(sgd, constant))
    assert trainer.optimizer.optimizer is sgd and trainer.scheduler is constant
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = trainer.train()
    assert state.log_history[0]["learning_rate"] == pytest.approx(0.05) and sgd.param_groups[0]["lr"] == 0.05
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("argument", ["quantization_config", "rollout_func"])
def test_unsupported_trl_arguments_are_refused(tmp_path, tiny_model_dir, prompt_dataset, argument):
    with pytest.raises(ConfigError, match=f"{argument}: "):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), prompt_dataset, **{argument: [len]})


# ------------------------------------------------------------------ TRL's methods and generation options
def test_get_high_entropy_mask_keeps_the_top_quantile_of_counted_tokens(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path), prompt_dataset)
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    # 10 counted tokens; the 0.8 quantile of 0.1..1.0 is 0.82: 0.9 and 1.0 stay, padding never does
    expected = torch.tensor([[0, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(trainer.get_high_entropy_mask(entropies, mask, 0.8), expected)
    assert torch.equal(trainer.get_high_entropy_mask(entropies, mask, 0.0), mask.bool())
    assert not trainer.get_high_entropy_mask(entropies, torch.zeros_like(mask), 0.5).any()


def test_do_sample_true_changes_nothing_and_false_is_refused(tmp_path, tiny_model_dir, prompt_dataset):
    plain = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "a", max_steps=1), prompt_dataset).train()
    sampled = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path / "b", max_steps=1,
                                                         generation_kwargs={"do_sample": True}), prompt_dataset).train()
    assert losses(sampled) == losses(plain)
    hf_path = config(tmp_path / "c", max_steps=1, generation_kwargs={"do_sample": True, "no_repeat_ngram_size": 50})
    GRPOTrainer(tiny_model_dir, frac_a, hf_path, prompt_dataset).train()  # transformers.generate got it once
    with pytest.raises(ConfigError, match="do_sample=False.*identical"):
        config(tmp_path, generation_kwargs={"do_sample": False})


def test_early_stopping_callback_reads_trls_metric_names(tmp_path, tiny_model_dir, prompt_dataset):
    from transformers import EarlyStoppingCallback

    args = config(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=1, metric_for_best_model="eval_reward",
                  greater_is_better=True, load_best_model_at_end=True)
    stopper = EarlyStoppingCallback(early_stopping_patience=1, early_stopping_threshold=10.0)  # never improves
    state = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset, eval_dataset=prompt_dataset.select(range(2)),
                        callbacks=[stopper]).train()
    # the first evaluation sets the best; the second cannot beat it by 10, and patience 1 stops right there
    assert state.global_step == 2 and state.best_metric is not None
    assert state.best_model_checkpoint.endswith("best")


# ------------------------------------------------------------------ TRL's documented reward-function shapes
def by_token_count(completion_ids, **kwargs):  # TRL docs, example 1: reads only completion_ids
    return [float(len(ids)) for ids in completion_ids]


def boxed_matches(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):  # examples 3 and 6
    import re

    found = [re.search(r"\\boxed\{(.*?)\}", c) for c in completions]
    found = [m.group(1) if m else None for m in found]
    rewards = [1.0 if f == g else 0.0 for f, g in zip(found, ground_truth)]
    if log_extra:
        log_extra("golden_answer", list(ground_truth))
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))
    return rewards


def math_only(prompts, completions, task, **kwargs):  # example 4: None where the task is not its own
    return [float(len(c) % 2) if t == "math" else None for c, t in zip(completions, task)]


async def non_empty(prompts, completions, **kwargs):  # example 5
    import asyncio

    await asyncio.sleep(0)
    return [1.0 if c else 0.0 for c in completions]


def test_trls_documented_reward_function_shapes_train_together(tmp_path, tiny_model_dir):
    from grpokit import GRPOConfig, GRPOTrainer as Trainer  # the only line a TRL script changes

    dataset = datasets.Dataset.from_list(
        [{"prompt": f"{i}*2=", "ground_truth": str(2 * i), "task": "math" if i % 2 else "code"} for i in range(4)])
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=8, report_to="none", log_completions=True, completions_logging_steps=1)
    trainer = Trainer(model=tiny_model_dir, reward_funcs=[by_token_count, boxed_matches, math_only, non_empty],
                      args=args, train_dataset=dataset)
    state = trainer.train()
    first = state.log_history[0]
    for name in ("by_token_count", "boxed_matches", "math_only", "non_empty"):
        assert f"rewards/{name}/mean" in first
    assert first["accuracy"] == first["rewards/boxed_matches/mean"]
    rows = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert all(r["golden_answer"] == str(2 * int(r["prompt"].split("*")[0])) for r in rows)
    assert all((r["rewards"]["math_only"] is None) == (int(r["prompt"].split("*")[0]) % 2 == 0) for r in rows)


def test_policy_loss_is_the_loss_without_the_entropy_bonus(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=2, entropy_coef=0.5, beta=0.0, gradient_accumulation_steps=2,
                  per_device_train_batch_size=4)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
    state = trainer.train()
    assert trainer.entropy_coef == 0.5 and trainer.aux_loss_enabled is False
    for row in [row for row in state.log_history if "loss" in row]:  # loss = policy_loss - coef x mean entropy
        assert row["policy_loss"] - row["loss"] == pytest.approx(0.5 * row["entropy"], rel=0.05)
        assert row["entropy_coef"] == 0.5


def test_get_off_policy_mask_is_trls():
    advantages = torch.tensor([[1.0], [-1.0], [-1.0]])
    logp = torch.zeros(3, 4)
    sampled = torch.tensor([[2.0] * 4, [0.5] * 4, [0.05, 0.05, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]])
    kept = GRPOTrainer.get_off_policy_mask(advantages, logp, sampled, mask, 0.1)
    assert kept.tolist() == [[1], [0], [1]]  # positive advantage; KL 0.5 > 0.1; padding's 9.0 not counted


def test_sequence_level_with_a_token_sum_warns(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, importance_sampling_level="sequence", loss_type="dapo"),
                prompt_dataset)
    assert "weights each sequence by its completion length" in caplog.text
    caplog.clear()
    GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, importance_sampling_level="sequence", loss_type="grpo"),
                prompt_dataset)
    assert "weights each sequence" not in caplog.text


def test_beam_search_is_refused():
    with pytest.raises(ConfigError, match="num_beams=2"):
        config(Path("/tmp"), generation_kwargs={"num_beams": 2})


def test_eval_loss_is_the_on_policy_loss_of_the_eval_groups(tmp_path, tiny_model_dir, prompt_dataset):
    from grpokit.algorithms import LossBatch, group_advantages, policy_loss
    from grpokit.rollout.generate import left_pad

    args = config(tmp_path, max_steps=1, beta=0.04, num_generations_eval=4, per_device_eval_batch_size=8)
    evalset = prompt_dataset.select(range(3))
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset,
                          eval_dataset=datasets.DatasetDict(small=evalset))
    result = trainer.evaluate()
    assert result["eval_small_loss"] == result["eval/small/loss"] and result["eval_small_reward"] == \
        result["eval/small/reward"]
    # the same completions scored again by hand, all 12 in one batch
    rows = [r for r in range(3) for _ in range(4)]
    rollout = trainer.collector.generate([trainer.eval_prompt_ids["small"][r] for r in rows], torch.arange(12) + 2**40)
    texts = trainer.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
    rewards = torch.tensor([frac_a(None, [t])[0] for t in texts]).unsqueeze(-1)
    advantages, _ = group_advantages(rewards, torch.ones(1), 4)
    prompt_ids, prompt_mask = left_pad([trainer.eval_prompt_ids["small"][r] for r in rows], 0)
    with torch.no_grad():
        logp, _ = trainer.learner.logprobs(trainer.model, prompt_ids, prompt_mask, rollout.completion_ids,
                                         rollout.completion_mask)
        ref, _ = trainer.learner.logprobs(trainer.ref_model, prompt_ids, prompt_mask, rollout.completion_ids,
                                        rollout.completion_mask)
    chunked = [policy_loss(LossBatch(logp[s:s + 8], advantages[s:s + 8], rollout.completion_mask[s:s + 8].float(),
                                     ref_logp=ref[s:s + 8]), trainer.loss_settings)[0].item() * n
               for s, n in ((0, 8), (8, 4))]
    assert result["eval/small/loss"] == pytest.approx(sum(chunked) / 12, rel=1e-5)

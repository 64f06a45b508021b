"""GRPOTrainer with use_vllm=True (colocate): weight sync proven step by step, the mismatch correction wired in,
resume, LoRA, and the trainer's random state left alone by vLLM's start-up."""

from __future__ import annotations

import datasets
import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.rollout.vllm_engine import VLLMColocateEngine
from grpokit.tiny import char_tokenizer, tiny_qwen2
from helpers import frac_a, read_jsonl
from vllm_support import requires_vllm

pytestmark = requires_vllm
LOGPROB_TOLERANCE = 2e-4  # fp32, measured ~1e-6 (test_rollout_engines.py)


@pytest.fixture
def model_dir(head32_model_dir):
    return head32_model_dir


def dataset():
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(24)])


def options(tmp_path, **extra) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"), use_vllm=True, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=12, learning_rate=0.05, max_steps=8, logging_steps=1, disable_tqdm=True,
        log_completions=False, seed=1,
    )
    values.update(extra)
    return GRPOConfig(**values)


def train(model_dir, args, **kwargs):
    from grpokit.trainer import GRPOTrainer

    trainer = GRPOTrainer(model_dir, [frac_a], args, dataset(), **kwargs)
    trainer.train()
    trainer.engine.close()
    return [r for r in read_jsonl(args.output_dir + "/metrics.jsonl") if "loss" in r]


def test_every_generation_uses_the_trainers_weights(model_dir, tmp_path):
    rows = train(model_dir, options(tmp_path))
    assert len(rows) == 8
    for row in rows:
        assert row["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE, row
        assert abs(row["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3
        assert 0 <= row["sampling/kl_sampler_trainer"] < 1e-6
        assert row["sampling/is_corrected_fraction"] == 0
    assert rows[-1]["reward"] != rows[0]["reward"]


def test_a_missed_sync_would_show(model_dir, tmp_path, monkeypatch):
    """The control for the test above: with the push switched off, the gap is large once the weights moved."""
    monkeypatch.setattr(VLLMColocateEngine, "sync_weights", lambda self, model, version: None)
    rows = train(model_dir, options(tmp_path, max_steps=4, vllm_importance_sampling_mode="token_truncate"))
    assert rows[0]["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE  # step 1: same weights
    assert rows[-1]["sampling/sampling_logp_difference/max"] > 0.05
    assert rows[-1]["sampling/is_corrected_fraction"] > 0 or rows[-1]["sampling/importance_sampling_ratio/max"] > 1.01


def test_correction_off_logs_no_sampling_metrics(model_dir, tmp_path):
    rows = train(model_dir, options(tmp_path, max_steps=2, vllm_importance_sampling_correction=False))
    assert not any(key.startswith("sampling/") for key in rows[0])


def test_resume_pushes_the_checkpoint_weights(model_dir, tmp_path):
    args = options(tmp_path, max_steps=3, save_strategy="steps", save_steps=3)
    train(model_dir, args)
    resumed = options(tmp_path, max_steps=5)
    from grpokit.trainer import GRPOTrainer

    trainer = GRPOTrainer(model_dir, [frac_a], resumed, dataset())  # its engine starts from the initial weights
    trainer.train(resume_from_checkpoint=True)
    trainer.engine.close()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[3]["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE


def test_lora_pushes_merged_weights(model_dir, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    rows = train(model_dir, options(tmp_path, max_steps=4, learning_rate=0.1), peft_config=lora)
    for row in rows:
        assert row["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE, row


def test_engine_start_leaves_the_random_state_alone(model_dir, tmp_path):
    from grpokit.trainer import GRPOTrainer

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    trainer = GRPOTrainer(model_dir, [frac_a], options(tmp_path, seed=123), dataset())  # set_seed(123), then vLLM
    assert torch.equal(torch.rand(3), expected)
    trainer.engine.close()


def test_unsupported_head_size_is_a_clear_error(tmp_path):
    from grpokit.rollout.engine import RolloutEngineError
    from grpokit.trainer import GRPOTrainer

    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_heads=4)  # head size 8
    with pytest.raises(RolloutEngineError, match="head sizes .* this model's is 8"):
        GRPOTrainer(model, [frac_a], options(tmp_path), dataset(), processing_class=tokenizer)


def test_sleep_mode_without_a_gpu_is_a_clear_error(model_dir, tmp_path):
    from grpokit.rollout.engine import RolloutEngineError
    from grpokit.trainer import GRPOTrainer

    if torch.cuda.is_available():
        pytest.skip("sleep mode is valid on a GPU")
    with pytest.raises(RolloutEngineError, match="vllm_enable_sleep_mode=True needs a CUDA GPU"):
        GRPOTrainer(model_dir, [frac_a], options(tmp_path, vllm_enable_sleep_mode=True), dataset())


def test_multi_turn_episodes_through_vllm_match_the_trainers_log_probs(model_dir, tmp_path):
    """Every turn is one vLLM generation; its sampler log-probs, laid end to end with 0 at the tool tokens, match
    the trainer's single forward pass over the whole transcript at the model's tokens."""
    from helpers import echo, register_test_formats

    register_test_formats()  # every turn is read as a call to echo: a random model makes tool calls
    args = options(tmp_path, max_steps=3, max_completion_length=64, tool_call_format="test_every_turn",
                   max_tool_calling_iterations=2)
    rows = train(model_dir, args, tools=[echo])
    assert len(rows) == 3
    for row in rows:
        assert row["tools/call_frequency"] > 0 and row["completions/tool_tokens_mean"] > 0
        assert row["tools/turns_mean"] > 1
        assert row["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE, row
        assert row["sampling/is_corrected_fraction"] == 0


def test_async_colocate_generates_with_the_snapshot_weights_of_each_version(model_dir, tmp_path):
    """max_staleness 1 with vLLM in the process: the producer streams the published snapshot's tensors (the
    version its batch is scheduled for) to vLLM before generating, with no copy of the model, so vLLM's log-probs
    are the snapshot's, a version behind the learner's from step 2 on (docs/async.md)."""
    import copy

    from grpokit.train.shadow import SnapshotPolicy
    from grpokit.passes import completion_logprobs
    from grpokit.rollout.generate import left_pad
    from grpokit.trainer import GRPOTrainer

    trainer = GRPOTrainer(model_dir, [frac_a], options(tmp_path, max_steps=5, max_staleness=1), dataset())
    producer = trainer.pipeline.collector
    assert isinstance(producer.policy, SnapshotPolicy)  # no shadow model for an engine with its own weights
    probe = copy.deepcopy(trainer.learner.unwrapped)  # the test's own model, loaded with each pushed snapshot
    gaps = []  # per generation: (the snapshot's version, max |vLLM log-prob - the snapshot's log-prob|)
    generate = producer.engine.generate

    def checked(request):
        rollout = generate(request)
        ids, mask = left_pad(request.prompt_ids, trainer.tokenizer.pad_token_id)
        probe.load_state_dict(producer.policy.snapshot.tensors)
        with torch.no_grad():
            logp, _ = completion_logprobs(probe, ids, mask, rollout.completion_ids, rollout.completion_mask,
                                          request.params.temperature)
        tokens = rollout.completion_mask.bool()
        gaps.append((producer.policy.version, (logp[tokens] - rollout.logprobs[tokens]).abs().max().item()))
        return rollout

    producer.engine.generate = checked
    trainer.train()
    trainer.engine.close()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [version for version, _ in gaps] == [0, 0, 1, 2, 3]  # batch b made by the weights of step b - 1
    assert all(gap < LOGPROB_TOLERANCE for _, gap in gaps), gaps
    assert [r["async/staleness/max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["sampling/sampling_logp_difference/max"] > 0.01 for r in rows[2:])  # behaviour != proximal

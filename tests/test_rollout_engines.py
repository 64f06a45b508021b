"""The rollout contract, run against every built-in engine: local, and vLLM in colocate mode (the server mode runs
the same checks in test_vllm_server.py, against a real `vllm serve` process).

Tolerances, measured on this CPU in fp32 (4-layer-free tiny Qwen2, head size 32): the local engine's log-probs
equal the trainer's forward to ~1e-6; vLLM's to ~1e-6 (its CPU kernels are oneDNN, the trainer's are ATen). The
assertions use 2e-4, well inside the 0.1-1 gaps a stale weight produces.
"""

from __future__ import annotations

import pytest
import torch

from grpokit.passes import completion_logprobs
from grpokit.rollout.engine import EngineContext, RolloutEngine, RolloutRequest, SamplingParams, pad_rollout
from grpokit.rollout.generate import eos_token_ids, left_pad
from grpokit.rollout.local import local_engine
from grpokit.tiny import char_tokenizer, tiny_qwen2
from grpokit.train.weights import named_weights
from vllm_support import requires_vllm

LOGPROB_TOLERANCE = 2e-4


def engine_model():
    """A tiny Qwen2 whose head size (32) vLLM's CPU attention supports."""
    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, seed=3)
    return model, tokenizer


class Options:
    """The engine options of a GRPOConfig, as plain attributes."""

    seed = 0
    bf16 = False
    vllm_mode = "colocate"
    vllm_enable_sleep_mode = False
    vllm_tensor_parallel_size = 1
    vllm_gpu_memory_utilization = 0.3


def make_engine(kind: str, model, tokenizer) -> RolloutEngine:
    context = EngineContext(
        model=model, tokenizer=tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id, max_model_length=96, options=Options(),
        extra={"max_concurrent_sequences": 16}, weights=lambda: named_weights(model),
    )
    if kind == "local":
        return local_engine(context)
    from grpokit.rollout.vllm_engine import vllm_engine

    return vllm_engine(context)


ENGINES = ["local", pytest.param("vllm", marks=requires_vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def setup(request):
    model, tokenizer = engine_model()
    engine = make_engine(request.param, model, tokenizer)
    yield request.param, engine, model, tokenizer
    engine.close()


def prompts(tokenizer):
    texts = ["1+2=", "12+30=", "7+7=", "99+1="]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def request_for(tokenizer, rows, ids, **sampling):
    params = SamplingParams(**{"max_completion_length": 12, **sampling})
    return RolloutRequest([prompts(tokenizer)[r] for r in rows], torch.tensor(ids), params, seed=7, return_logprobs=True)


def trainer_logprobs(model, tokenizer, prompt_ids, rollout, temperature=1.0):
    ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, mask, rollout.completion_ids, rollout.completion_mask, temperature)
    return logp * rollout.completion_mask


def test_rollout_shapes_masks_and_truncation(setup):
    kind, engine, model, tokenizer = setup
    assert isinstance(engine, RolloutEngine)
    rows = [0, 0, 1, 1, 2, 2, 3, 3]
    out = engine.generate(request_for(tokenizer, rows, range(8)))
    n, t = out.completion_ids.shape
    assert n == 8 and t <= 12
    assert out.completion_ids.dtype == torch.long and out.truncated.dtype == torch.bool
    assert out.completion_mask.shape == (8, t) and out.logprobs.shape == (8, t) and out.logprobs.dtype == torch.float32
    eos = set(eos_token_ids(model, tokenizer))
    for row in range(8):
        kept = out.completion_mask[row].bool()
        length = int(kept.sum())
        assert kept[:length].all() and not kept[length:].any()  # one run of ones from position 0
        tokens = out.completion_ids[row, :length].tolist()
        ends_with_eos = tokens[-1] in eos
        assert not any(tok in eos for tok in tokens[:-1])  # nothing counts after the first EOS
        assert bool(out.truncated[row]) == (not ends_with_eos)
        if out.truncated[row]:
            assert length == 12
        assert (out.completion_ids[row, length:] == tokenizer.pad_token_id).all()
        assert (out.logprobs[row, length:] == 0).all() and (out.logprobs[row, :length] < 0).all()


def test_logprobs_match_the_trainer_forward(setup):
    kind, engine, model, tokenizer = setup
    rows = [0, 1, 2, 3, 0, 1, 2, 3]
    request = request_for(tokenizer, rows, range(100, 108), temperature=0.7)
    out = engine.generate(request)
    ours = trainer_logprobs(model, tokenizer, request.prompt_ids, out, temperature=0.7)
    assert (ours - out.logprobs).abs().max() < LOGPROB_TOLERANCE


def test_completions_do_not_depend_on_the_batch(setup):
    kind, engine, model, tokenizer = setup
    rows, ids = [0, 1, 2, 3, 0, 1], [10, 11, 12, 13, 14, 15]
    batch = engine.generate(request_for(tokenizer, rows, ids))
    for k in (0, 3, 5):
        alone = engine.generate(request_for(tokenizer, [rows[k]], [ids[k]]))
        width = alone.completion_ids.shape[1]
        assert torch.equal(alone.completion_ids[0], batch.completion_ids[k, :width])
        assert int(batch.completion_mask[k].sum()) == int(alone.completion_mask[0].sum())
    reordered = engine.generate(request_for(tokenizer, rows[::-1], ids[::-1]))
    width = min(reordered.completion_ids.shape[1], batch.completion_ids.shape[1])
    assert torch.equal(reordered.completion_ids.flip(0)[:, :width], batch.completion_ids[:, :width])


def test_sample_ids_and_seed_decide_the_draw(setup):
    kind, engine, model, tokenizer = setup
    same_prompt = engine.generate(request_for(tokenizer, [0] * 6, range(6)))
    distinct = {tuple(r[m.bool()].tolist()) for r, m in zip(same_prompt.completion_ids, same_prompt.completion_mask)}
    assert len(distinct) >= 5  # G samples of one prompt differ (random init: near-uniform distribution)
    again = engine.generate(request_for(tokenizer, [0] * 6, range(6)))
    assert torch.equal(again.completion_ids, same_prompt.completion_ids)


def test_min_new_tokens_and_filters(setup):
    kind, engine, model, tokenizer = setup
    out = engine.generate(request_for(tokenizer, [0, 1, 2, 3], range(4), generation_kwargs={"min_new_tokens": 12}))
    assert (out.completion_mask.sum(-1) == 12).all()
    greedy = engine.generate(request_for(tokenizer, [0, 1], [0, 1], top_k=1))
    logits_first = model(torch.tensor([prompts(tokenizer)[0]])).logits[0, -1]
    assert int(greedy.completion_ids[0, 0]) == int(logits_first.argmax())
    assert greedy.logprobs[0, 0].abs() < 1e-5  # top_k = 1: the processed distribution is one token


def test_sync_weights_moves_the_engine_to_new_weights(setup):
    kind, engine, model, tokenizer = setup
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        request = request_for(tokenizer, [0, 1, 2, 3], range(200, 204))
        if kind != "local":  # an engine with its own copy of the weights is stale until synced
            stale = engine.generate(request)
            gap = (trainer_logprobs(model, tokenizer, request.prompt_ids, stale) - stale.logprobs).abs().max()
            assert gap > 0.05
        engine.sync_weights(named_weights(model), version=1)
        fresh = engine.generate(request)
        assert fresh.weights_version in (None, 1)
        gap = (trainer_logprobs(model, tokenizer, request.prompt_ids, fresh) - fresh.logprobs).abs().max()
        assert gap < LOGPROB_TOLERANCE
    finally:
        model.load_state_dict(original)
        engine.sync_weights(named_weights(model), version=2)


def test_pad_rollout_follows_the_local_mask_rule():
    out = pad_rollout([[5, 1, 7], [4, 4], []], [[-0.5, -0.25, -1.0], [-2.0, -3.0], []], eos_ids=[1], pad_id=0)
    assert out.completion_ids.tolist() == [[5, 1, 0], [4, 4, 0], [0, 0, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0]]
    assert out.truncated.tolist() == [False, True, True]
    assert out.logprobs.tolist() == [[-0.5, -0.25, 0.0], [-2.0, -3.0, 0.0], [0.0, 0.0, 0.0]]


# ---------------------------------------------------------------- a user's own engine, through the trainer


class RepeatLastToken:
    """A user's engine: each completion repeats the prompt's last token twice, then EOS."""

    name = "repeat-last"

    def __init__(self, context: EngineContext) -> None:
        self.context = context
        self.syncs: list[int] = []

    def generate(self, request: RolloutRequest):
        eos = self.context.eos_token_ids[0]
        tokens = [[p[-1], p[-1], eos] for p in request.prompt_ids]
        logprobs = [[-1.0, -1.0, -1.0] for _ in tokens] if request.return_logprobs else None
        return pad_rollout(tokens, logprobs, self.context.eos_token_ids, self.context.pad_token_id)

    def sync_weights(self, weights, version: int) -> None:
        self.syncs.append(version)

    def close(self) -> None:
        pass


def make_repeat_last(context: EngineContext) -> RepeatLastToken:
    return RepeatLastToken(context)


@pytest.mark.parametrize("spec", ["repeat-last", "test_rollout_engines:make_repeat_last"])
def test_a_registered_or_imported_engine_drives_training(spec, tiny_model_dir, prompt_dataset, tmp_path):
    from grpokit.config import GRPOConfig
    from grpokit.rollout import register_rollout_engine
    from grpokit.trainer import GRPOTrainer
    from helpers import read_jsonl

    register_rollout_engine("repeat-last")(make_repeat_last)
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(len(c)) for c in completions]

    args = GRPOConfig(output_dir=str(tmp_path), rollout_engine=spec, max_steps=3, num_generations=4,
                      per_device_train_batch_size=8, max_completion_length=8, log_completions=False, disable_tqdm=True)
    trainer = GRPOTrainer(tiny_model_dir, [reward], args, prompt_dataset)
    trainer.train()
    assert isinstance(trainer.engine, RepeatLastToken)
    assert trainer.engine.syncs == [1, 2]  # before generations 2 and 3: each after an optimizer step
    assert seen and all(len(c) == 2 and c[0] == c[1] == "=" for c in seen)  # every prompt ends with "="
    row = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert row["sampling/sampling_logp_difference/max"] > 0  # the engine's fake log-probs are compared
    assert row["completions/mean_length"] == 3


def quarter_weights(ratio, clip_min, clip_max):
    """A user's own mismatch mode, named by import path: every weight 0.25."""
    return torch.full_like(ratio, 0.25)


def test_a_mismatch_mode_given_as_an_import_path_trains(tiny_model_dir, prompt_dataset, tmp_path):
    from grpokit.config import GRPOConfig
    from grpokit.rollout import register_rollout_engine
    from grpokit.trainer import GRPOTrainer
    from helpers import frac_a, read_jsonl

    register_rollout_engine("repeat-last")(make_repeat_last)  # its log-probs differ from the trainer's
    args = GRPOConfig(output_dir=str(tmp_path), rollout_engine="repeat-last", max_steps=2, num_generations=4,
                      vllm_importance_sampling_mode="test_rollout_engines:quarter_weights",
                      per_device_train_batch_size=8, max_completion_length=8, log_completions=False, disable_tqdm=True,
                      logging_steps=1)
    GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset).train()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:  # the weights are the user's mode's, on every token
        assert [row[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max")] == [0.25] * 3


def test_unknown_engines_and_conflicting_options_are_named(tmp_path):
    from grpokit.config import ConfigError, GRPOConfig

    with pytest.raises(ConfigError, match="rollout_engine='vllmm' is not valid; choose one of: local, .*vllm"):
        GRPOConfig(rollout_engine="vllmm")
    from grpokit.rollout import register_rollout_engine
    from grpokit.rollout.engine import resolve_engine

    register_rollout_engine("repeat-last")(make_repeat_last)
    with pytest.raises(ConfigError, match="use_vllm=True and rollout_engine='repeat-last'"):
        GRPOConfig(use_vllm=True, rollout_engine="repeat-last")
    vllm_only = [  # the vllm engine's own checks (check_vllm_options): they run when vLLM is the engine
        ({"vllm_mode": "remote"}, "vllm_mode='remote' is not valid; choose one of: colocate, server."),
        ({"vllm_server_base_url": "localhost:8000"}, "must start with http"),
    ]
    for options, message in vllm_only:
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(use_vllm=True, **options)
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(rollout_engine="vllm", **options)
        GRPOConfig(**options)  # the local engine reads none of them
    for options, message in [  # numbers outside their declared Range are refused whatever the engine
        ({"vllm_server_port": 0}, r"vllm_server_port=0 must be an integer in \[1, 65535\]"),
        ({"vllm_server_timeout": float("nan")}, r"vllm_server_timeout=nan must be a finite number in \(0, 86400\]"),
        ({"vllm_gpu_memory_utilization": 1.5}, r"must be a finite number in \(0, 1\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(**options)
    with pytest.raises(ConfigError, match="2 problems in the options"):  # an engine's problems come together
        GRPOConfig(use_vllm=True, vllm_server_port=0, vllm_tensor_parallel_size=0)
    for options, message in [
        ({"vllm_importance_sampling_mode": "token"}, "choose one of: sequence_mask, sequence_truncate"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5}, "must be less than"),
        ({"vllm_importance_sampling_clip_max": None}, "needs at least one of"),
        ({"vllm_importance_sampling_clip_max": float("inf")}, r"clip_max=inf must be a finite number in \(0, 1000000\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            GRPOConfig(**options)
    with pytest.raises(ValueError, match="'no_such_module:factory': could not import module 'no_such_module'"):
        resolve_engine("no_such_module:factory")  # import paths are resolved when the trainer starts


def test_an_engines_own_checks_run_when_it_is_chosen():
    from grpokit.config import ConfigError, GRPOConfig
    from grpokit.rollout import register_rollout_engine

    def needs_a_budget(config):
        return [] if "budget" in config.loss_kwargs else ["the 'budgeted' engine needs loss_kwargs: {budget: N}."]

    register_rollout_engine("budgeted", check_options=needs_a_budget)(make_repeat_last)
    with pytest.raises(ConfigError, match="^the 'budgeted' engine needs loss_kwargs"):
        GRPOConfig(rollout_engine="budgeted")
    assert GRPOConfig(rollout_engine="budgeted", loss_kwargs={"budget": 3}).rollout_engine == "budgeted"
    GRPOConfig()  # another engine is chosen: not its check


def test_pad_rollout_when_pad_is_also_eos():
    """Many tokenizers pad with their EOS: padding must not read as the end of a completion that never ended."""
    out = pad_rollout([[5, 6, 7], [4, 4]], None, eos_ids=[0], pad_id=0)
    assert out.completion_ids.tolist() == [[5, 6, 7], [4, 4, 0]]
    assert out.completion_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert out.truncated.tolist() == [True, True]

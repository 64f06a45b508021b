"""Packed forwards through flash-attention's varlen kernel: transformers' flash_attention_2 integration, unchanged,
around a stand-in `flash_attn` package.

flash-attn runs on CUDA only. The stand-in computes what its kernels compute — softmax(q k^T * scale) v within each
sequence that cu_seqlens delimits, causal (aligned at the bottom right, as flash-attn >= 2.1), grouped-query heads —
in plain fp32 PyTorch, with the real functions' signatures (transformers inspects them to choose its arguments).
So everything between grpokit and the kernel is the code a GPU runs: grpokit's one-row layout with a prompt per
sample (`packing.unshared`), the boundaries it passes (cu_seq_lens_q/k, max_length_q/k), transformers' routing of
them through the model to `flash_attn_varlen_func`. The packed pass must equal the padded sdpa pass (values and
gradients, fp32), and training must not depend on how a token budget groups the samples."""

import sys
import types

import datasets
import pytest
import torch
import transformers
from transformers import modeling_flash_attention_utils as flash_utils

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.passes import packing
from grpokit.passes import packs, varlen
from test_packing import assert_same, family_model, ragged_batch, values_and_grads

CALLS: list[tuple[int, bool]] = []  # (sequences, with gradient) of each flash_attn_varlen_func call


def _attend(q, k, v, causal: bool, softmax_scale):
    """One sequence: q (Sq, h, d), k and v (Sk, hk, d) -> (Sq, h, d)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:  # query i (of Sq) sees keys j <= i + Sk - Sq
        rows = torch.arange(q.shape[0]).unsqueeze(1) + (k.shape[0] - q.shape[0])
        scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > rows, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and not softcap and block_table is None
    assert cu_seqlens_q.dtype == torch.int32 and isinstance(max_seqlen_q, int)
    lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
    assert max(lengths) == max_seqlen_q
    bounds = list(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist(), cu_seqlens_k[:-1].tolist(),
                      cu_seqlens_k[1:].tolist()))
    CALLS.append((len(bounds), q.requires_grad))
    return torch.cat([_attend(q[a:b], k[c:d], v[c:d], causal, softmax_scale) for a, b, c, d in bounds])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    return torch.stack([_attend(q[i], k[i], v[i], causal, softmax_scale) for i in range(q.shape[0])])


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the stand-in has no paged kernel")


@pytest.fixture
def flash(monkeypatch):
    """flash_attention_2 on this CPU: the stand-in package, and transformers told that flash-attn is installed."""
    package = types.ModuleType("flash_attn")
    package.flash_attn_func, package.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    package.flash_attn_with_kvcache = flash_attn_with_kvcache
    padding = types.ModuleType("flash_attn.bert_padding")
    padding.pad_input, padding.unpad_input = flash_utils._pad_input, flash_utils._unpad_input
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.bert_padding", padding)
    monkeypatch.setattr(flash_utils, "is_flash_attn_2_available", lambda *a, **k: True)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", None)  # import the stand-in's functions
    from grpokit.passes import dispatch

    monkeypatch.setattr(dispatch, "PACK_WHEN", float("inf"))  # these tiny batches always pack
    CALLS.clear()
    yield


def flash_model(family: str):
    """A tiny fp32 model of `family` whose attention is flash_attention_2 (switched after loading: from_pretrained
    refuses flash-attn without CUDA)."""
    model = family_model(family)
    model.config._attn_implementation = "flash_attention_2"
    return model


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "phi3", "mistral"])
def test_varlen_packed_equals_padded_sdpa(flash, family):
    model = flash_model(family)
    assert varlen(model) and packs(model)
    batch = ragged_batch()
    packed = values_and_grads(model, batch, True)
    assert CALLS == [(8, True)] * 2  # one call per layer, the eight samples as eight sequences
    model.config._attn_implementation = "sdpa"
    assert_same(packed, values_and_grads(model, batch, False))


def test_varlen_with_gradient_checkpointing_and_lora(flash):
    from peft import LoraConfig, get_peft_model

    model = flash_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"],
                                             init_lora_weights=False))
    model.enable_input_require_grads()
    model.train()
    assert varlen(model)
    batch = ragged_batch(seed=5)
    packed = values_and_grads(model, batch, True)
    model.base_model.model.config._attn_implementation = "sdpa"
    assert_same(packed, values_and_grads(model, batch, False))


def test_unshared_layout_gives_each_sample_its_own_prompt_and_boundaries():
    prompts, completions, groups = [3, 3, 5], [4, 0, 2], [0, 0, 1]
    layout = packing.unshared([2, 0, 1], groups, prompts, completions)
    assert layout.rows == [[(1, [2]), (0, [0]), (0, [1])]] and layout.width == 17 and layout.fills == [17]
    ids = torch.arange(1, 6).repeat(3, 1)
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    completion_ids = torch.tensor([[11, 12, 13, 14], [0, 0, 0, 0], [21, 22, 0, 0]])
    completion_mask = (completion_ids > 0).long()
    pack = packing.build(layout, ids, prompt_mask, completion_ids, completion_mask)
    assert pack.input_ids.tolist() == [[1, 2, 3, 4, 5, 21, 22, 3, 4, 5, 11, 12, 13, 14, 3, 4, 5]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    offsets, longest = packing.boundaries(pack)
    assert offsets.tolist() == [0, 7, 14, 17] and offsets.dtype == torch.int32 and longest == 7


def length_reward(prompts, completions, **kwargs):
    return [len(c) / 10.0 + (0.5 if "a" in c else 0.0) for c in completions]


def train(model_dir, tmp_path, name, attention, **options):
    args = GRPOConfig(
        output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=12, max_prompt_length=16, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", seed=3, report_to=[], disable_tqdm=True, beta=0.05, num_iterations=2, **options,
    )
    prompts = datasets.Dataset.from_list([{"prompt": f"{i}+{i * 3}="} for i in range(16)])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)  # weights linear in the gradients: compared tightly
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model, length_reward, args, prompts, processing_class=tokenizer, optimizers=(sgd, None))
    model.config._attn_implementation = attention
    trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.learner.unwrapped.named_parameters()}


def test_training_through_varlen_equals_sdpa_for_any_budget(flash, tiny_model_dir, tmp_path):
    """The same run through the sdpa padded path and through flash varlen forwards (automatic budget, and a small
    one that cuts each step into several forwards counting every prompt copy): equal losses and weights."""
    _, reference = train(tiny_model_dir, tmp_path, "sdpa", "sdpa", token_budget=0, padding_free=False)
    trained = {}
    for budget in (None, 40):
        CALLS.clear()
        trainer, weights = train(tiny_model_dir, tmp_path, f"flash{budget}", "flash_attention_2",
                                 token_budget=budget)
        trained[budget] = [n for n, grad in CALLS if grad]  # the update's forwards (2 layers each)
        for name, value in weights.items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)
    # automatic budget: one forward of the 8 samples per optimizer step (2 steps x 2 layers); 40 tokens: several
    assert trained[None] == [8] * (2 * 2)
    assert len(trained[40]) > len(trained[None]) and sum(trained[40]) == sum(trained[None])

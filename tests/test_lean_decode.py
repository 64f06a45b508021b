"""The lean decode step computes what the transformers forward computes, and falls back where it cannot."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import grpokit.rollout.generate as generate_module
from grpokit.models.kv_cache import cache_kwargs
from grpokit.rollout.generate import SamplingParams, generate_completions, left_pad
from grpokit.rollout.lean_decode import LeanDecoder, supports
from grpokit.tiny import char_tokenizer


def _qwen2_gqa():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(config).eval()


def _llama():
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("build", [_qwen2_gqa, _llama])
@torch.no_grad()
def test_lean_step_matches_the_transformers_forward(build):
    model = build()
    assert supports(model)
    ids, attention = left_pad([[5, 6, 7, 8, 9], [10, 11], [3, 4, 5]], 0)  # left padding on two rows
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    caches = []
    for _ in range(2):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=True,
              **cache_kwargs(model, cache))
        caches.append(cache)
    lean = LeanDecoder(model, caches[0], max_new_tokens=6)
    token, position = torch.tensor([20, 30, 1]), positions[:, -1]
    for _ in range(6):
        position = position + 1
        attention = torch.cat([attention, torch.ones(3, 1, dtype=attention.dtype)], 1)
        reference = model(input_ids=token[:, None], attention_mask=attention, position_ids=position[:, None],
                          use_cache=True, **cache_kwargs(model, caches[1])).logits[:, -1]
        ours = lean.step(token, position, attention.bool())
        assert torch.allclose(ours, reference, atol=1e-5, rtol=0)
        token = reference.argmax(-1)


def test_unsupported_models_fall_back():
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_qwen2_gqa(), peft.LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert not supports(lora.get_base_model())  # LoRA layers are not plain nn.Linear
    scaled = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert not supports(scaled)


def test_rollout_tokens_equal_with_and_without_the_lean_step(monkeypatch):
    tokenizer = char_tokenizer()
    torch.manual_seed(2)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    model = Qwen2ForCausalLM(config)
    prompts = [tokenizer(p)["input_ids"] for p in ("12+3=", "4+5=", "100+20=")]
    rows = [p for p in prompts for _ in range(4)]
    params = SamplingParams(max_completion_length=12, temperature=0.9, top_k=20, repetition_penalty=1.1)
    lean = generate_completions(model, tokenizer, rows, torch.arange(12), params, seed=3)
    monkeypatch.setattr(generate_module, "supports_lean_decode", lambda model: False)
    plain = generate_completions(model, tokenizer, rows, torch.arange(12), params, seed=3)
    assert torch.equal(lean.completion_ids, plain.completion_ids)
    assert torch.equal(lean.completion_mask, plain.completion_mask)

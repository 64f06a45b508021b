"""The KV cache reaches the model under the name its forward takes: `past_key_values`, or `cache` (transformers'
new name, which 5.24 has and which replaces the old one in 5.40), in the decode loop and the shared-prompt pass."""

import warnings

import torch
from transformers import Qwen2ForCausalLM

from grpokit.models.kv_cache import cache_keyword, cache_kwargs
from grpokit.passes import Tokens
from grpokit.passes.forward import completion_logits
from grpokit.rollout.engine import SamplingParams
from grpokit.rollout.generate import generate_completions
from grpokit.tiny import char_tokenizer, tiny_qwen2


class CacheNamedQwen2(Qwen2ForCausalLM):
    """A model of the new API: its forward takes `cache` and refuses `past_key_values`."""

    calls = 0

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None, **kwargs):
        assert "past_key_values" not in kwargs, "the old name reached a model that takes `cache`"
        CacheNamedQwen2.calls += cache is not None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=use_cache, **{cache_keyword(Qwen2ForCausalLM): cache}, **kwargs)


def cache_named(model: Qwen2ForCausalLM) -> CacheNamedQwen2:
    new = CacheNamedQwen2(model.config)
    new.load_state_dict(model.state_dict())
    return new


class Wrapper(torch.nn.Module):  # the shape of DDP: the model under .module
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_the_keyword_is_read_off_the_forward_signature():
    old = tiny_qwen2(40, hidden_size=32, num_layers=1, seed=0)
    assert cache_keyword(Qwen2ForCausalLM) in ("past_key_values", "cache")  # the installed transformers' own name
    assert cache_keyword(CacheNamedQwen2) == "cache"
    assert list(cache_kwargs(Wrapper(cache_named(old)), "C")) == ["cache"]  # through a DDP-like wrapper
    assert cache_keyword(type("NoForward", (), {"forward": len})) == "past_key_values"  # no signature: the old name


def test_shared_prompt_pass_and_decode_loop_pass_the_cache_under_the_new_name():
    model = tiny_qwen2(40, hidden_size=32, num_layers=2, seed=0).eval()
    renamed = cache_named(model).eval()
    prompts = torch.tensor([[5, 6, 7]] * 2 + [[0, 8, 9]] * 2)
    prompt_mask = (prompts != 0).long()
    completions = torch.randint(2, 40, (4, 5), generator=torch.Generator().manual_seed(0))
    completion_mask = torch.ones_like(completions)
    CacheNamedQwen2.calls = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning either way
        shared = completion_logits(renamed, Tokens(prompts, prompt_mask, completions, completion_mask), share_prompts=True)
        plain = completion_logits(model, Tokens(prompts, prompt_mask, completions, completion_mask), share_prompts=False)
    assert CacheNamedQwen2.calls == 2  # the prompt pass and the completion pass both got the shared cache
    torch.testing.assert_close(shared, plain, rtol=1e-5, atol=1e-5)

    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=2, seed=0).eval()
    renamed = cache_named(model).eval()
    params = SamplingParams(max_completion_length=6)
    ids = [[5, 6, 7], [5, 6, 7], [8, 9]]
    before = CacheNamedQwen2.calls
    new = generate_completions(renamed, tokenizer, ids, torch.arange(3), params, seed=1)
    old = generate_completions(model, tokenizer, ids, torch.arange(3), params, seed=1)
    assert CacheNamedQwen2.calls > before
    assert torch.equal(new.completion_ids, old.completion_ids)

"""Tiny, offline language models and tokenizers built locally.

Tests, the demo and the benchmarks need a real `transformers` causal LM and a real tokenizer without touching a
model hub. This module builds both from scratch: a character-level tokenizer (`tokenizers` WordLevel over single
characters, wrapped in `PreTrainedTokenizerFast`, with a small chat template) and a random-init Qwen2 model.
Both save with `save_pretrained`, so the normal `from_pretrained(path)` loading path is exercised on them.
"""

from __future__ import annotations

import itertools
import string

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
DEFAULT_CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"

# Renders [{"role": ..., "content": ...}, ...] as "role: content\n" lines; the generation prompt opens an
# assistant turn. Small on purpose: a character-level model learns it in a few steps.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# A tool-calling template in the style of Qwen2.5's (Hermes tool calls), for tests and examples of multi-turn
# rollouts: the tools' names in a system line, calls as <tool_call>{json}</tool_call>, results in a tool turn
# as <tool_response>...</tool_response>, and every assistant turn closed by <eos> (its end-of-turn token).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}system: tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}{{ '\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}assistant: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}<eos>\n"
    "{% elif m['role'] == 'tool' %}tool: <tool_response>{{ m['content'] }}</tool_response>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def char_tokenizer(chars: str = DEFAULT_CHARS) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus <pad> (id 0) and <eos> (id 1)."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for ch in dict.fromkeys(chars):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


REAL_VOCAB_SIZE = 151_936  # Qwen2 / Qwen2.5 / Qwen3


def synthetic_words(count: int) -> list[str]:
    """`count` distinct lowercase words made of consonant-vowel syllables (ba, be, ..., baba, ...), in a fixed order."""
    syllables = [c + v for c in "bcdfghjklmnpqrstvwxz" for v in "aeiou"]  # 100
    words = (
        "".join(parts) for length in itertools.count(1) for parts in itertools.product(syllables, repeat=length)
    )
    return list(itertools.islice(words, count))


def word_tokenizer(vocab_size: int = REAL_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with exactly `vocab_size` entries: <pad> (0), <eos> (1), the single characters of
    DEFAULT_CHARS, then synthetic words. Text splits on whitespace and punctuation; every id decodes to its word,
    so a model over this vocabulary samples real, scoreable text at a real vocabulary size."""
    vocab = {PAD_TOKEN: 0, EOS_TOKEN: 1}
    for ch in dict.fromkeys(DEFAULT_CHARS):
        vocab[ch] = len(vocab)
    for word in synthetic_words(vocab_size):
        if len(vocab) == vocab_size:
            break
        vocab.setdefault(word, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_qwen2(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
) -> Qwen2ForCausalLM:
    """A random-init Qwen2 causal LM (fp32) of the given size; deterministic for a given seed."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    return model


def tiny_model_and_tokenizer(
    hidden_size: int = 64, num_layers: int = 2, seed: int = 0, chars: str = DEFAULT_CHARS
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """A matching (model, tokenizer) pair: the model's vocabulary is exactly the tokenizer's."""
    tok = char_tokenizer(chars)
    model = tiny_qwen2(len(tok), hidden_size=hidden_size, num_layers=num_layers, seed=seed)
    return model, tok

"""Offline stand-ins for the Hugging Face Hub ids that TRL's GRPO tests load.

`benchmarks/trl_suite.py` runs TRL's own GRPO test file with its hub ids (`trl-internal-testing/tiny-...` models and
the `trl-internal-testing/zen` dataset) rewritten to local folders built here. Everything is made from scratch, with
no network: random-init tiny models (hidden size 16, 2 layers) saved with `save_pretrained`, byte-level BPE tokenizers
trained on a small local corpus, our own chat templates, and a Zen-of-Python dataset folder with a `configs:` README.

Tokenizers come in three families:

* "qwen" (the Qwen3 / Qwen3-MoE / remote-code causal LMs and the Qwen reward models): TRL's tool and environment
  tests feed hand-written token ids of the real Qwen2.5 vocabulary to patched `generate` calls (eos 151645, pad
  151643, `<tool_call>` 151657, word pieces such as 4913 = '{"'), and those tests use these models. This family keeps
  the Qwen id layout: the 256 byte symbols at ids 0..255 in the usual byte-level order, the word pieces those tests
  name pinned at their ids (`QWEN_PINNED_PIECES`), special tokens at their ids, and synthetic filler words in between
  so every id decodes to something. Only ~1,000 entries are real BPE merges; the vocabulary has the real size
  (151,936 model rows), which costs a policy model about 4x per training step on CPU.
* "qwen-compact" (`tiny-Qwen2ForCausalLM-2.5`, the policy in most tests): the same markers and template, but 32,768
  entries (the same ~1,200 merges plus filler), special tokens appended, to keep the bulk of the suite fast.
* "small" (Llama, Mistral, Gemma2, Cohere2, GPT-OSS, GLM-4-MoE, Nemotron-H): a ~600-entry vocabulary with other
  markers, so "a reward model with another tokenizer and chat template" is really different.

Both chat templates are our own: system/user/assistant/tool roles, `add_generation_prompt`, `enable_thinking`,
tools listed in a system turn, tool calls rendered as `<tool_call>\\n{json}\\n</tool_call>`, `{% generation %}` marks
around assistant turns. Each tokenizer also ships a matching `response_template` so tool calls can be parsed.

Vision models and image datasets are not built (`SKIPPED` says why).
"""

from __future__ import annotations

import contextlib
import functools
import codecs
import io
import itertools
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

STANDIN_VERSION = "5"  # bump to force a rebuild of cached stand-ins
HUB_ORG = "trl-internal-testing"
QWEN_VOCAB_SIZE = 151_936  # rows in the real tiny Qwen models' embedding
QWEN_BASE_SIZE = 151_643  # ids below this are ordinary (non-special) vocabulary in Qwen2.5

# Special tokens of the "qwen" family, at the ids TRL's tests use for them.
QWEN_SPECIALS = {
    151643: "<|endoftext|>",  # pad
    151644: "<|im_start|>",
    151645: "<|im_end|>",  # eos
    151657: "<tool_call>",
    151658: "</tool_call>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}
QWEN_SPECIAL_END = 151669  # tokenizer size; ids in [151643, 151669) not listed above become <|reserved_N|>

# Multi-byte word pieces that TRL's GRPO tests reference by their Qwen2.5 id (decoded text as written in the tests'
# comments, e.g. '<tool_call>\n{"name": "multiply_tool", ...'). Single bytes need no pinning: the byte order gives them.
QWEN_PINNED_PIECES = {
    293: " b", 314: " {", 330: ' "', 397: ">\n", 411: "out", 450: "de", 497: '",', 522: "</", 606: "name",
    788: '":', 894: " any", 927: "sh", 944: "'t", 1318: "text", 1414: " know", 1513: " don", 2765: " won",
    4913: '{"', 5212: ' {"', 5392: " tool", 6023: "hi", 6659: "call", 7692: "async", 9520: "step", 11248: "}}\n",
    13477: "crement", 14172: "tool", 16252: " increment", 16370: "arguments", 17453: "Done", 22785: "_tool",
    35744: "increment", 64648: "multiply", 93054: "_multiply", 95642: '"}}\n',
}  # fmt: skip

SMALL_SPECIALS = ["<|pad|>", "<|start|>", "<|end|>", "<|finetune_right_pad_id|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>", "<think>", "</think>"]  # fmt: skip


@dataclass(frozen=True)
class TokenizerFamily:
    name: str
    turn_start: str  # opens a turn, followed by the role and a newline
    turn_end: str  # closes a turn; also the eos token
    pad: str
    specials: tuple[str, ...]  # appended after the BPE entries, unless `qwen_ids`
    bpe_size: int
    size: int | None = None  # pad the ordinary vocabulary with filler words up to this many entries
    qwen_ids: bool = False  # lay ids out like Qwen2.5 (see the module docstring)


QWEN = TokenizerFamily("qwen", "<|im_start|>", "<|im_end|>", "<|endoftext|>", (), 1200, QWEN_BASE_SIZE, qwen_ids=True)
# 32k entries: a random-init policy then rarely samples eos by chance, which
# test_train_with_mask_truncated_completions_all_masked relies on, at a third of the real vocabulary's cost.
QWEN_COMPACT = TokenizerFamily(
    "qwen-compact", "<|im_start|>", "<|im_end|>", "<|endoftext|>", tuple(QWEN_SPECIALS.values()), 1200,
    32768 - len(QWEN_SPECIALS),
)
SMALL = TokenizerFamily("small", "<|start|>", "<|end|>", "<|pad|>", tuple(SMALL_SPECIALS), 600)


@dataclass(frozen=True)
class ModelSpec:
    name: str  # hub name under trl-internal-testing/
    config_class: str  # transformers config class
    head: str  # "causal" or "reward"
    family: TokenizerFamily
    overrides: dict = field(default_factory=dict)
    remote_code: bool = False


_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2}
_MOE_QWEN3 = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "decoder_sparse_step": 1}

MODEL_SPECS = [
    ModelSpec("tiny-Qwen2ForCausalLM-2.5", "Qwen2Config", "causal", QWEN_COMPACT,
              {**_ATTN, "tie_word_embeddings": True}),
    ModelSpec("tiny-Qwen2ForSequenceClassification-2.5", "Qwen2Config", "reward", QWEN, {**_ATTN}),
    ModelSpec("tiny-Qwen3ForCausalLM", "Qwen3Config", "causal", QWEN, {**_ATTN, "head_dim": 8}),
    ModelSpec("tiny-Qwen3ForSequenceClassification", "Qwen3Config", "reward", QWEN, {**_ATTN, "head_dim": 8}),
    ModelSpec("tiny-Qwen3MoeForCausalLM", "Qwen3MoeConfig", "causal", QWEN, {**_ATTN, "head_dim": 8, **_MOE_QWEN3}),
    ModelSpec("tiny-RemoteForCausalLM", "Qwen2Config", "causal", QWEN, {**_ATTN}, remote_code=True),
    ModelSpec("tiny-LlamaForCausalLM-3.2", "LlamaConfig", "causal", SMALL, {**_ATTN, "tie_word_embeddings": True}),
    ModelSpec("tiny-LlamaForSequenceClassification-3.2", "LlamaConfig", "reward", SMALL, {**_ATTN}),
    ModelSpec("tiny-MistralForCausalLM-0.2", "MistralConfig", "causal", SMALL, {**_ATTN}),
    ModelSpec("tiny-Gemma2ForCausalLM", "Gemma2Config", "causal", SMALL,
              {**_ATTN, "head_dim": 8, "tie_word_embeddings": True}),
    ModelSpec("tiny-Cohere2ForCausalLM", "Cohere2Config", "causal", SMALL, {**_ATTN}),
    ModelSpec("tiny-GptOssForCausalLM", "GptOssConfig", "causal", SMALL,
              {**_ATTN, "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
    ModelSpec("tiny-Glm4MoeForCausalLM", "Glm4MoeConfig", "causal", SMALL,
              {**_ATTN, "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
               "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    ModelSpec("tiny-NemotronHForCausalLM-nano", "NemotronHConfig", "causal", SMALL,
              {**_ATTN, "head_dim": 8, "layers_block_type": ["mamba", "attention"], "mamba_num_heads": 4,
               "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16}),
]  # fmt: skip

# Hub ids the GRPO tests use that get no stand-in here (vision is out of scope; the others are real hub checkpoints).
SKIPPED = {
    f"{HUB_ORG}/zen-image": "image dataset (vision out of scope)",
    f"{HUB_ORG}/zen-multi-image": "image dataset (vision out of scope)",
    **{
        f"{HUB_ORG}/{name}": "vision model (out of scope)"
        for name in [
            "tiny-Qwen2_5_VLForConditionalGeneration",
            "tiny-Qwen2VLForConditionalGeneration",
            "tiny-Gemma3ForConditionalGeneration",
            "tiny-Gemma4ForConditionalGeneration",
            "tiny-LlavaForConditionalGeneration",
            "tiny-LlavaNextForConditionalGeneration",
            "tiny-SmolVLMForConditionalGeneration",
            "tiny-Qwen3_5ForConditionalGeneration-NoThink",
            "tiny-Qwen3_5MoeForConditionalGeneration-3.6",
        ]
    },
}


# ----------------------------------------------------------------------------------------------------------- text


def zen_lines() -> list[str]:
    """The 19 aphorisms of the Zen of Python, from the standard library's `this` module (which prints on import)."""
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[2:] if line.strip()]


# How many leading words of each aphorism form the prompt. The first twelve are the prompts of the real dataset, which
# test_prepare_input_called_with_correct_data spells out; the rest are cut in the same spirit.
ZEN_PROMPT_WORDS = [4, 2, 3, 1, 4, 3, 1, 4, 3, 3, 2, 6, 4, 6, 4, 6, 7, 7, 6]


def split_line(line: str, n_words: int) -> tuple[str, str]:
    """('Beautiful is better than ugly.', 4) -> ('Beautiful is better than', ' ugly.')."""
    words = line.split(" ")
    return " ".join(words[:n_words]), " " + " ".join(words[n_words:])


def corpus() -> list[str]:
    """Training text for the BPE merges: the Zen lines, chat-like turns, and tool-call JSON."""
    lines = zen_lines()
    tool_json = [
        '{"name": "multiply_tool", "arguments": {"a": 3, "b": 4}}',
        '{"name": "increment", "arguments": {"step": 1}}',
        '{"name": "shout", "arguments": {"text": "hi"}}',
        '{"type": "function", "function": {"name": "tool", "description": "Multiplies two integers.", '
        '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}',
    ]
    chat = ["system", "user", "assistant", "tool", "You are a helpful assistant.", "I don't know any tool.", "Done!"]
    return (lines + tool_json + chat) * 3


# ----------------------------------------------------------------------------------------------------- tokenizers


_PRINTABLE_BYTES = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_ORDER = _PRINTABLE_BYTES + [b for b in range(256) if b not in _PRINTABLE_BYTES]


def byte_to_symbol() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable bytes stand for themselves, the others are shifted
    to code points from 256 up."""
    symbol = {b: chr(b) for b in _PRINTABLE_BYTES}
    for offset, b in enumerate(_BYTE_ORDER[len(_PRINTABLE_BYTES) :]):
        symbol[b] = chr(256 + offset)
    return symbol


def byte_symbols() -> list[str]:
    """The 256 byte symbols in the conventional id order (printable bytes first): id 0 is '!', 198 is newline."""
    symbol = byte_to_symbol()
    return [symbol[b] for b in _BYTE_ORDER]


def to_byte_level(text: str) -> str:
    symbol = byte_to_symbol()
    return "".join(symbol[b] for b in text.encode("utf-8"))


def filler_words():
    """Endless distinct synthetic words (ba, be, ..., baba, ...), alternately with a leading byte-level space."""
    syllables = [c + v for c in "bcdfghjklmnpqrstvwxz" for v in "aeiou"]
    for n, parts in enumerate(itertools.chain.from_iterable(itertools.product(syllables, repeat=k) for k in (1, 2, 3))):
        yield ("Ġ" if n % 2 else "") + "".join(parts)


@functools.lru_cache(maxsize=None)
def train_merges(size: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn `size` byte-level BPE entries on `corpus()`; returns the learned multi-symbol tokens and the merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(corpus(), trainer)
    state = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    learned = [t for t, _ in sorted(state["vocab"].items(), key=lambda kv: kv[1]) if len(t) > 1]
    return tuple(learned), tuple(merges)


def assign_ids(family: TokenizerFamily) -> dict[str, int]:
    """The family's vocabulary (byte-level strings -> ids), special tokens excluded."""
    learned, _ = train_merges(family.bpe_size)
    vocab = {s: i for i, s in enumerate(byte_symbols())}
    reserved = set()
    if family.qwen_ids:
        for i, text in QWEN_PINNED_PIECES.items():
            vocab[to_byte_level(text)] = i
        reserved = set(QWEN_PINNED_PIECES)
    free = (i for i in itertools.count(256) if i not in reserved)
    for token in learned:
        if token not in vocab:
            vocab[token] = next(free)
    if family.size:  # fill every remaining ordinary id so that any sampled id decodes to text
        fillers = (w for w in filler_words() if w not in vocab)
        used = set(vocab.values())
        for i in range(256, family.size):
            if i not in used:
                vocab[next(fillers)] = i
    return vocab


def special_tokens(family: TokenizerFamily, first_id: int) -> dict[str, int]:
    if family.qwen_ids:
        names = {i: QWEN_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(QWEN_BASE_SIZE, QWEN_SPECIAL_END)}
        return {name: i for i, name in names.items()}
    return {name: first_id + k for k, name in enumerate(family.specials)}


NL = "{{ '\\n' }}"  # a newline that survives the trim_blocks option transformers renders templates with


def chat_template(family: TokenizerFamily) -> str:
    """Our own chat template: one `<start>role\\n...<end>\\n` block per message, tools listed in a system turn, tool
    calls as `<tool_call>\\n{json}\\n</tool_call>`. The pieces are joined with no layout whitespace."""
    s, e = family.turn_start, family.turn_end
    parts = [
        "{% set system = messages[0].content if messages and messages[0].role == 'system' else none %}",
        "{% set turns = messages[1:] if system is not none else messages %}",
        # system turn: the system message and/or the tool list
        "{% if system is not none or tools %}",
        f"{s}system\n",
        "{% if system is not none %}{{ system }}{% endif %}",
        "{% if tools %}",
        "{% if system is not none %}", NL, NL, "{% endif %}",
        "Tools you can call:",
        "{% for tool in tools %}", NL, "{{ (tool.function if tool.function is defined else tool) | tojson }}",
        "{% endfor %}", NL,
        'Call a tool with <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>',
        "{% endif %}",
        f"{e}\n",
        "{% endif %}",
        # conversation turns
        "{% for m in turns %}",
        "{% if m.role == 'assistant' %}",
        f"{s}assistant\n",
        "{% generation %}{{ m.content or '' }}",
        "{% for call in (m.tool_calls or []) %}",
        "{% set f = call.function if call.function is defined else call %}",
        "{% if m.content or not loop.first %}", NL, "{% endif %}",
        '<tool_call>\n{"name": {{ f.name | tojson }}, "arguments": ',
        "{{ f.arguments | tojson if f.arguments is mapping else f.arguments }}}\n</tool_call>",
        "{% endfor %}",
        f"{e}{{% endgeneration %}}", NL,
        "{% elif m.role == 'tool' %}",
        f"{s}tool\n<tool_response>\n{{{{ m.content }}}}\n</tool_response>{e}\n",
        "{% else %}",
        f"{s}{{{{ m.role }}}}\n{{{{ m.content }}}}{e}\n",
        "{% endif %}",
        "{% endfor %}",
        # generation prompt, with an empty thinking block when thinking is switched off
        "{% if add_generation_prompt %}",
        f"{s}assistant\n",
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}",
        "{% endif %}",
    ]  # fmt: skip
    return "".join(parts)


def response_template(family: TokenizerFamily) -> dict:
    """Parsing spec (transformers' `response_template`) for an assistant turn rendered by `chat_template`."""
    return {
        "defaults": {"role": "assistant"},
        "start_anchor": f"{family.turn_start}assistant\n",
        "fields": {
            "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": re.escape(family.turn_end) + r"\s*", "content": "text"},
        },
    }


_TOKENIZERS: dict[str, object] = {}


def build_tokenizer(family: TokenizerFamily):
    """A `PreTrainedTokenizerFast` for the family (built once per process)."""
    if family.name in _TOKENIZERS:
        return _TOKENIZERS[family.name]
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = assign_ids(family)
    specials = special_tokens(family, first_id=len(vocab))
    _, merges = train_merges(family.bpe_size)
    core = Tokenizer(models.BPE(vocab={**vocab, **specials}, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=family.pad,
        eos_token=family.turn_end,
        extra_special_tokens={},
        model_max_length=32768,
    )
    tok.chat_template = chat_template(family)
    tok.response_template = response_template(family)
    _TOKENIZERS[family.name] = tok
    return tok


# --------------------------------------------------------------------------------------------------------- models


def build_config(spec: ModelSpec, tok):
    import transformers

    vocab_size = QWEN_VOCAB_SIZE if spec.family.qwen_ids else len(tok)
    pad_id, eos_id = tok.pad_token_id, tok.eos_token_id
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        max_position_embeddings=4096,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    kwargs.update(spec.overrides)
    if spec.head == "reward":
        kwargs["num_labels"] = 1
    return getattr(transformers, spec.config_class)(**kwargs)


def build_model(spec: ModelSpec, tok, seed: int):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    config = build_config(spec, tok)
    auto = AutoModelForCausalLM if spec.head == "causal" else AutoModelForSequenceClassification
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto.from_config(config, dtype=torch.float32)
    if spec.head == "causal":
        model.generation_config = GenerationConfig(
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, do_sample=True
        )
    return model


REMOTE_CONFIG_PY = '''from transformers import Qwen2Config


class RemoteConfig(Qwen2Config):
    model_type = "remote"
'''

REMOTE_MODELING_PY = '''from transformers import Qwen2ForCausalLM

from .configuration_remote import RemoteConfig


class RemoteForCausalLM(Qwen2ForCausalLM):
    config_class = RemoteConfig
'''


def make_remote_code(folder: Path) -> None:
    """Turn a saved Qwen2 model folder into a custom-code model that needs `trust_remote_code=True`."""
    (folder / "configuration_remote.py").write_text(REMOTE_CONFIG_PY)
    (folder / "modeling_remote.py").write_text(REMOTE_MODELING_PY)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["model_type"] = "remote"
    config["architectures"] = ["RemoteForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_remote.RemoteConfig",
        "AutoModelForCausalLM": "modeling_remote.RemoteForCausalLM",
    }
    config_path.write_text(json.dumps(config, indent=2))


def save_model(spec: ModelSpec, folder: Path, seed: int) -> None:
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tok = build_tokenizer(spec.family)
    model = build_model(spec, tok, seed)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if spec.remote_code:
        make_remote_code(tmp)
    (tmp / ".standin-version").write_text(STANDIN_VERSION)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


def is_current(folder: Path) -> bool:
    marker = folder / ".standin-version"
    return marker.exists() and marker.read_text() == STANDIN_VERSION


# -------------------------------------------------------------------------------------------------------- dataset

ZEN_CONFIGS = [
    "standard_prompt_only",
    "standard_prompt_completion",
    "conversational_prompt_only",
    "conversational_prompt_completion",
]


def zen_rows(config: str) -> list[dict]:
    rows = []
    for line, n_words in zip(zen_lines(), ZEN_PROMPT_WORDS, strict=True):
        prompt, completion = split_line(line, n_words)
        if config.startswith("conversational"):
            row = {"prompt": [{"role": "user", "content": f"Complete this line of the Zen of Python: {prompt}"}]}
            if config.endswith("completion"):
                row["completion"] = [{"role": "assistant", "content": completion.strip()}]
        else:
            row = {"prompt": prompt}
            if config.endswith("completion"):
                row["completion"] = completion
        rows.append(row)
    return rows


def save_zen(folder: Path, n_test: int = 2) -> None:
    """A dataset folder `load_dataset(folder, config, split=...)` reads offline: parquet files plus README configs."""
    from datasets import Dataset

    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    yaml = ["---", "configs:"]
    for config in ZEN_CONFIGS:
        rows = zen_rows(config)
        splits = {"train": rows[:-n_test], "test": rows[-n_test:]}
        yaml.append(f"- config_name: {config}")
        yaml.append("  data_files:")
        for split, split_rows in splits.items():
            path = f"{config}/{split}-00000-of-00001.parquet"
            (tmp / config).mkdir(parents=True, exist_ok=True)
            Dataset.from_list(split_rows).to_parquet(str(tmp / path))
            yaml += [f"  - split: {split}", f"    path: {path}"]
    yaml += ["---", "", "Local stand-in for trl-internal-testing/zen: the Zen of Python, split into prompts.", ""]
    (tmp / "README.md").write_text("\n".join(yaml))
    (tmp / ".standin-version").write_text(STANDIN_VERSION)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)


# ---------------------------------------------------------------------------------------------------------- build


def build_all(cache_dir: Path, log=print) -> tuple[dict[str, str], dict[str, str]]:
    """Build (or reuse) every stand-in under `cache_dir`.

    Returns `(mapping, missing)`: hub id -> local folder for what was built, and hub id -> reason for what was not
    (the `SKIPPED` ids plus any model whose construction failed here).
    """
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    cache_dir = Path(cache_dir)
    mapping, missing = {}, dict(SKIPPED)
    zen = cache_dir / "datasets" / "zen"
    if not is_current(zen):
        log(f"building dataset stand-in {zen}")
        save_zen(zen)
    mapping[f"{HUB_ORG}/zen"] = str(zen)
    for seed, spec in enumerate(MODEL_SPECS):
        hub_id, folder = f"{HUB_ORG}/{spec.name}", cache_dir / "models" / spec.name
        try:
            if not is_current(folder):
                log(f"building model stand-in {folder}")
                save_model(spec, folder, seed)
            mapping[hub_id] = str(folder)
        except Exception as exc:  # a transformers version without this architecture, or a config it rejects
            missing[hub_id] = f"could not build: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            log(f"  skipped {hub_id}: {missing[hub_id]}")
    return mapping, missing

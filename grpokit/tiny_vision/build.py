"""The parts every tiny vision-language fixture shares: a character-level tokenizer with a family's special tokens
and chat template, the family's image processor class for this machine, a seeded random init, the generation
config's special ids, saving to a folder, and the switch that lets transformers build and load processors with a
video sub-processor where torchvision is missing."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)
from transformers import PreTrainedTokenizerFast

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n\t"


def char_tokenizer(
    special: Iterable[str],
    *,
    template: str,
    eos: str,
    pad: str,
    bos: str | None = None,
    unk: str | None = None,
    added: Iterable[str] = (),
    add_bos: bool = False,
    named: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of CHARS, then the family's `special` tokens (never split, skipped
    when decoding with skip_special_tokens) and its `added` tokens (never split, kept when decoding), in that order.
    `add_bos` puts `bos` in front of every encoding, as the family's tokenizer does (Gemma, Llama/Mistral);
    `named` sets the extra named tokens a family's processor reads (tokenizer.boi_token, ...). A character outside
    CHARS becomes `unk` (or `pad` for families without an unknown token: their byte-level BPE has none)."""
    special, added = list(dict.fromkeys(special)), list(dict.fromkeys(added))
    vocab = {ch: i for i, ch in enumerate(dict.fromkeys(CHARS))}
    for token in special + added:
        vocab.setdefault(token, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk or pad))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if add_bos:
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    names = {"eos_token": eos, "pad_token": pad, "bos_token": bos, "unk_token": unk}
    tok = PreTrainedTokenizerFast(tokenizer_object=core, extra_special_tokens=named or {},
                                  **{k: v for k, v in names.items() if v is not None})
    tok.chat_template = template
    return tok


def token_ids(tok: PreTrainedTokenizerFast, **tokens: str) -> dict[str, int]:
    """{name: id} for {name: token}; every token must be in the vocabulary as one token."""
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in tokens.items()}
    unknown = [tokens[name] for name, i in ids.items() if i is None or tok.convert_ids_to_tokens(i) != tokens[name]]
    if unknown:
        raise ValueError(f"not in the tokenizer's vocabulary: {unknown}")
    return ids


def image_processor(name: str, **kwargs):
    """The family's image processor class `name` (e.g. "Qwen2VLImageProcessor"): the torchvision one where
    torchvision is installed (what AutoImageProcessor picks), else its PIL twin (`name` + "Pil" in transformers 5;
    transformers 4 has only the PIL one, under `name`)."""
    import transformers
    from transformers.utils import is_torchvision_available

    cls = None if is_torchvision_available() else getattr(transformers, f"{name}Pil", None)
    return (cls or getattr(transformers, name))(**kwargs)


def seeded(build: Callable[[], torch.nn.Module], seed: int) -> torch.nn.Module:
    """`build()` under torch.manual_seed(seed), leaving the caller's RNG as it was; fp32, eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.float().eval()


def set_generation_ids(model, tok: PreTrainedTokenizerFast, stops: Iterable[str], bos: str | None = None) -> None:
    """The generation config's stop, pad and BOS ids as the family's generation_config.json has them."""
    model.generation_config.eos_token_id = [tok.convert_tokens_to_ids(t) for t in stops]
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.convert_tokens_to_ids(bos) if bos else None


def video_processor_optional() -> None:
    """Let transformers build and load a processor that has a video sub-processor without one, where torchvision is
    missing. Idempotent; does nothing where torchvision is installed.

    Why: in transformers 5 every video processor needs torchvision (Qwen2VLVideoProcessor imports it; the others
    raise "requires the Torchvision library"), and the Qwen2-VL / Qwen2.5-VL / Qwen3-VL processors list
    `video_processor` among their sub-processors, so without torchvision `Qwen2VLProcessor(image_processor=...,
    tokenizer=...)` fails in ProcessorMixin's class check (processing_utils.py, check_argument_for_proper_class)
    and `AutoProcessor.from_pretrained` fails loading the video processor. torchvision is not a grpokit dependency
    and the PyPI wheel does not match the CPU torch build this project's machines use.

    What: `ProcessorMixin.get_attributes` (the list of sub-processors that __init__ checks, save_pretrained writes
    and from_pretrained loads) leaves out the video processor. The processor is then the family's own class with
    `video_processor` unset: text and images work as shipped; videos do not (an AttributeError)."""
    from transformers.processing_utils import (
        ProcessorMixin,
        _get_modality_for_attribute,
    )
    from transformers.utils import is_torchvision_available

    if is_torchvision_available() or getattr(ProcessorMixin, "_grpokit_video_optional", False):
        return
    stock = ProcessorMixin.get_attributes.__func__

    def get_attributes(cls):
        return [name for name in stock(cls) if _get_modality_for_attribute(name) != "video_processor"]

    ProcessorMixin.get_attributes = classmethod(get_attributes)
    ProcessorMixin._grpokit_video_optional = True


def save(model, processor, folder: str | Path) -> Path:
    """Write `model` and `processor` to `folder` (created if needed) with save_pretrained, so that
    AutoProcessor.from_pretrained(folder) and AutoModelForImageTextToText.from_pretrained(folder) load them back
    offline (for the Qwen families without torchvision: after video_processor_optional(), in the loading process
    too)."""
    video_processor_optional()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder

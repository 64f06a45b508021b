"""Loading the policy, its tokenizer and (only when beta != 0) the reference model."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger("grpokit")


class ModelError(ValueError):
    """The model or tokenizer cannot be used; the message says how to fix it."""


def is_peft_model(model: Any) -> bool:
    """A PEFT PeftModel (checked without importing peft when it is not loaded)."""
    import sys

    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_model_object(model: Any) -> bool:
    """A model given as an object: a transformers PreTrainedModel or a PEFT PeftModel wrapping one."""
    return isinstance(model, PreTrainedModel) or is_peft_model(model)


def check_model_source(model: Any) -> None:
    """Fail fast (before the tokenizer or any weights load) on a model that is neither an object nor a folder/name."""
    if is_model_object(model):
        return
    if not isinstance(model, (str, Path)):
        raise ModelError(
            f"model must be a path, a hub name, a PreTrainedModel or a PeftModel, got {type(model).__name__}."
        )
    name = str(model)
    looks_local = name.startswith((".", "/", "~")) or Path(name).exists()
    if looks_local and not Path(name).expanduser().is_dir():
        raise ModelError(f"Model path {name!r} does not exist; pass a folder written by save_pretrained or a hub name.")


def model_config(model: str | PreTrainedModel, init_kwargs: dict[str, Any]):
    """The model's config alone (no weights); None when it cannot be read (load_policy reports the real problem)."""
    if is_model_object(model):
        return model.config
    try:
        return AutoConfig.from_pretrained(str(model), trust_remote_code=init_kwargs.get("trust_remote_code", False))
    except (OSError, ValueError):
        return None


def context_length(model: str | PreTrainedModel, init_kwargs: dict[str, Any]) -> int | None:
    """The model's max_position_embeddings, read from its config alone (no weights); None when unknown."""
    return config_context(model_config(model, init_kwargs))


def config_context(config) -> int | None:
    """A config's context length (a vision-language model's: its language model's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None) or getattr(config, "max_position_embeddings", None)


def is_vision_language(config) -> bool:
    """The config is a vision-language model's (a vision tower beside the language model)."""
    return getattr(config, "vision_config", None) is not None


def auto_class(source: str | Path, init_kwargs: dict[str, Any]):
    """AutoModelForImageTextToText for a vision-language model's folder or name (TRL's class for them), else
    AutoModelForCausalLM."""
    if is_vision_language(model_config(str(source), init_kwargs)):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_policy(model: str | PreTrainedModel, init_kwargs: dict[str, Any]) -> PreTrainedModel:
    """A model object as given, or `from_pretrained(name_or_path, **init_kwargs)` of AutoModelForCausalLM
    (AutoModelForImageTextToText for a vision-language model)."""
    check_model_source(model)
    if is_model_object(model):
        return model
    name = str(model)
    try:
        return auto_class(name, init_kwargs).from_pretrained(name, **init_kwargs)
    except OSError as exc:
        raise ModelError(
            f"Could not load model {name!r}: {exc}. Check the name, or download it first and pass the local folder."
        ) from exc


def load_tokenizer(model: str | PreTrainedModel, processing_class=None, trust_remote_code: bool = False):
    """The given tokenizer (a processor's own tokenizer), or the one saved beside the model; a missing pad token
    becomes the EOS token."""
    tokenizer = getattr(processing_class, "tokenizer", None) or processing_class
    if tokenizer is None:
        check_model_source(model)
        source = model if isinstance(model, (str, Path)) else model.config._name_or_path
        try:
            tokenizer = _from_pretrained_tokenizer(str(source), trust_remote_code)
        except (OSError, ValueError) as exc:
            raise ModelError(
                f"No tokenizer found for {source!r}; pass processing_class=<tokenizer> to GRPOTrainer."
            ) from exc
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ModelError("The tokenizer has neither a pad token nor an EOS token; set tokenizer.pad_token.")
        logger.warning("The tokenizer has no pad token; using its EOS token %r for padding.", tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained_tokenizer(source: str, trust_remote_code: bool = False):
    """AutoTokenizer, except that a folder saved with a generic tokenizer.json pipeline is loaded as saved.

    transformers 5 replaces the saved class by the model type's own tokenizer for some model types (qwen2 among
    them), which rebuilds the pre-tokenizer and silently drops characters of a custom vocabulary.
    """
    config = Path(source) / "tokenizer_config.json"
    if config.is_file() and (Path(source) / "tokenizer.json").is_file():
        saved_class = json.loads(config.read_text()).get("tokenizer_class")
        if saved_class in ("TokenizersBackend", "PreTrainedTokenizerFast"):
            return PreTrainedTokenizerFast.from_pretrained(source)
    return AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)


def reference_model(policy: PreTrainedModel, source: str | PreTrainedModel, init_kwargs: dict) -> PreTrainedModel:
    """A frozen copy of the starting policy (reloaded from its path when it came from one)."""
    if isinstance(source, (str, Path)):
        ref = auto_class(source, init_kwargs).from_pretrained(str(source), **init_kwargs)
    else:
        ref = copy.deepcopy(policy)
    ref.eval()
    ref.requires_grad_(False)
    return ref


def read_weights(folder: Path, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the model files save_pretrained wrote into `folder` (model.safetensors or its
    model-0000k-of-0000n shards), never a checkpoint's other safetensors files (reference.safetensors); with
    `model`, under the model's own state-dict names (`saved_names`)."""
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(shard))
    if not state:
        raise ModelError(f"{folder} holds no safetensors weights.")
    if model is not None:
        rename = saved_names(model)
        state = {rename.get(name, name): tensor for name, tensor in state.items()}
    return state


def saved_names(model: torch.nn.Module) -> dict[str, str]:
    """{name save_pretrained writes: the model's state-dict name}. transformers 5 renames some families' weights
    when it saves them (Qwen2-VL's `model.language_model.layers.*` become `model.layers.*`, Gemma 3's
    `model.vision_tower.*` `vision_tower.*`, ...) and back when from_pretrained loads them; a resume that loads a
    checkpoint into a live model reverses the renaming here. Only renames are reversed: where a conversion merges
    or splits tensors, names are left as saved (and a mismatch is reported by the caller)."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: no renaming on save for the models grpokit trains there
        return {}
    owners: dict[int, list[str]] = {}
    for name, tensor in state.items():
        owners.setdefault(id(tensor), []).append(name)
    reverted = revert_weight_conversion(model, dict(state))
    if not all(id(tensor) in owners for tensor in reverted.values()):
        return {}
    return {saved: max(owners[id(tensor)], key=lambda name: _common_suffix(name, saved))
            for saved, tensor in reverted.items()}


def _common_suffix(a: str, b: str) -> int:
    """Characters a and b share at their ends (picks a tied weight's own name among the names of its tensor)."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Load the safetensors weights saved by `save_pretrained` (whole models or PEFT adapters) into `model`
    (the model's files only: see read_weights)."""
    adapter = folder / "adapter_model.safetensors"
    if adapter.is_file():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(adapter))
        return
    state = read_weights(folder, model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ModelError(f"Checkpoint {folder} does not match the model: missing {missing}, unexpected {unexpected}.")

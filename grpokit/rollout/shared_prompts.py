"""Forward passes that run each distinct prompt once, however many completions share it.

GRPO scores G completions of every prompt, so a batch holds each prompt G times. The prompt's keys and values
do not depend on the completion (causal attention), so the prompt is run once per distinct prompt, its KV cache
is copied to its G rows (`index_select`, which sums the G rows' gradients back into the one prompt pass), and
only the completion tokens run per row. The logits are the same function of the weights as one full forward of
[prompt, completion]; only the order of floating-point operations differs.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U,) index of the first row of each distinct (ids, mask) row, and (b,) the distinct row of every row."""
    keys = torch.cat([prompt_ids, prompt_mask], 1)  # (b, 2P)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (b,)
    rows = torch.arange(keys.shape[0], device=keys.device)
    first = torch.full((int(inverse.max()) + 1,), keys.shape[0], dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # (U,)
    return first, inverse


def completion_logits(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, share_prompts: bool = True,
) -> torch.Tensor:
    """(b, T, V) logits whose position t predicts completion token t, from (b, P) left-padded prompts and
    (b, T) right-padded completions. With share_prompts, each distinct prompt runs once (see the module doc)."""
    attention = torch.cat([prompt_mask, completion_mask], 1)  # (b, P + T)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    prompt_width, width = prompt_ids.shape[1], completion_ids.shape[1]
    first, inverse = distinct_rows(prompt_ids, prompt_mask) if share_prompts else (None, None)
    if first is None or first.shape[0] == prompt_ids.shape[0]:
        ids = torch.cat([prompt_ids, completion_ids], 1)
        return model(
            input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=width + 1, use_cache=False
        ).logits[:, :-1]
    cache = DynamicCache(config=getattr(model, "config", None))
    head = model(
        input_ids=prompt_ids[first], attention_mask=prompt_mask[first], position_ids=positions[first, :prompt_width],
        past_key_values=cache, use_cache=True, logits_to_keep=1,
    ).logits  # (U, 1, V): the last prompt position predicts completion token 0
    cache.reorder_cache(inverse)  # (U, ...) -> (b, ...)
    tail = model(
        input_ids=completion_ids, attention_mask=attention, position_ids=positions[:, prompt_width:],
        past_key_values=cache, use_cache=True, logits_to_keep=width,
    ).logits  # (b, T, V): completion position t predicts token t + 1
    return torch.cat([head[inverse], tail[:, :-1]], 1)

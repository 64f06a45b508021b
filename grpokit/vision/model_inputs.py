"""The model's side of image prompts: what a forward over rows with images takes besides ids and mask.

    kwargs = forward_inputs(visions, prompt_mask, extra=T)    # pixels, grids, ... and per-token fields
    positions = rope_positions(model, visions, prompt_ids, prompt_mask, T)   # (3, b, P + T), or None

Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): image tokens sit on a (t, h, w) grid and the text after an image
resumes at the image's largest position + 1, so a sample's positions are not its token count. They are computed
here per prompt, from that prompt alone (`get_rope_index` on its own unpadded ids), and carried explicitly into
every forward: completion token t of a prompt of p tokens is at p + t + delta, delta the prompt's own offset.
Nothing is read from the model's stored `rope_deltas` (state that goes stale across batches, transformers#44873).
The other families take plain positions (0..L-1 over each row's tokens).
"""

from __future__ import annotations

import torch

from grpokit.models.kv_cache import causal_lm
from grpokit.vision.inputs import PromptVision, collate, token_field_rows


def inner(model):
    """The multimodal model inside a ...ForConditionalGeneration (which owns get_rope_index, get_image_features)."""
    lm = causal_lm(model)
    return getattr(lm, "model", lm)


# config attributes naming the tokens that stand for an image's (or video's) features
PLACEHOLDER_KEYS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def placeholder_ids(model) -> list[int]:
    """Ids of the tokens a vision-language model fills with vision features: never sampled (a completion holding
    one would have no features to fill it with). Empty for a text model."""
    config = getattr(causal_lm(model), "config", None)
    if getattr(config, "vision_config", None) is None:
        return []
    ids = {getattr(config, key, None) for key in PLACEHOLDER_KEYS}
    return sorted(i for i in ids if isinstance(i, int) and i >= 0)


def is_mrope(model) -> bool:
    """The model places tokens with multimodal RoPE (3-D positions from get_rope_index)."""
    return callable(getattr(inner(model), "get_rope_index", None))


def prompt_rope(model, ids: list[int] | torch.Tensor, vision: PromptVision | None) -> tuple[torch.Tensor, int]:
    """(3, p) positions of one prompt's p tokens and its delta (last position + 1 - p), from the prompt alone."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    if vision is None:
        return torch.arange(ids.shape[1]).expand(3, -1), 0
    types = vision.token_fields["mm_token_type_ids"].reshape(1, -1)
    positions, delta = inner(model).get_rope_index(ids, mm_token_type_ids=types,
                                                   image_grid_thw=vision.tensors.get("image_grid_thw"))
    return positions[:, 0].cpu(), int(delta.reshape(-1)[0])


def rope_positions(model, visions: list[PromptVision | None], prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   completion_width: int = 0) -> torch.Tensor | None:
    """(3, b, P + T) positions of b left-padded prompts (P wide) and their T completion tokens (0 on padding), for
    a multimodal-RoPE model; None for other models (plain positions). Each distinct prompt computed once."""
    if not is_mrope(model):
        return None
    rows, width = prompt_mask.shape
    out = torch.zeros((3, rows, width + completion_width), dtype=torch.long)
    lengths = prompt_mask.sum(-1).tolist()
    known: dict = {}
    ids_cpu = prompt_ids.cpu()
    for row, (vision, length) in enumerate(zip(visions, lengths)):
        ids = ids_cpu[row, width - length:]
        key = (None if vision is None else vision.key, tuple(ids.tolist()))
        if key not in known:
            known[key] = prompt_rope(model, ids, vision)
        positions, delta = known[key]
        out[:, row, width - length:width] = positions
        out[:, row, width:] = torch.arange(length, length + completion_width) + delta
    return out.to(prompt_ids.device)


def forward_inputs(visions: list[PromptVision | None], prompt_mask: torch.Tensor, extra: int = 0) -> dict:
    """The keyword arguments of one forward over these rows' prompts (left-padded by prompt_mask (U, P)) and
    `extra` text positions after them: the images' tensors in row order, and the per-token fields (U, P + extra).
    Empty when no row has images."""
    present = [v for v in visions if v is not None]
    if not present:
        return {}
    names = sorted({name for v in present for name in v.token_fields})
    out = collate(visions, prompt_mask.device)
    out.update(token_field_rows(visions, names, prompt_mask, extra))
    return out

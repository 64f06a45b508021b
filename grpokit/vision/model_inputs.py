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

import inspect

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
    """(3, p) positions of one prompt's p tokens and its delta (last position + 1 - p), from the prompt alone (the
    ids may continue past the prompt the vision was made for: text)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
    if vision is None:
        return torch.arange(ids.shape[1]).expand(3, -1), 0
    types = torch.zeros_like(ids)  # the prompt's own types; text after it (a later turn's context) is 0
    own = vision.token_fields["mm_token_type_ids"][: ids.shape[1]]
    types[0, : own.shape[0]] = own
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


def encoded_once(model, visions: list[PromptVision | None], prompt_mask: torch.Tensor, extra: int = 0) -> dict:
    """`forward_inputs` for rows whose prompts repeat (G completions of a prompt, each in its own row), with each
    distinct prompt's images encoded once: one get_image_features call over the distinct prompts, its per-image
    (or per-tile) outputs gathered for the rows in their order and handed over as mm_encoder_outputs (in place of
    the pixels, which every family here accepts). Gradients reach the tower through that one encoding."""
    out = forward_inputs(visions, prompt_mask, extra)
    if not out:
        return out
    distinct = list({v.key: v for v in visions if v is not None}.values())
    index = {v.key: k for k, v in enumerate(distinct)}
    images = collate(distinct, prompt_mask.device)
    pixels = images.pop("pixel_values")
    encoder = inner(model).get_image_features
    wanted = inspect.signature(encoder).parameters
    features = encoder(pixels, **{k: v for k, v in images.items() if k in wanted}, return_dict=True)
    counts = [v.num_images for v in distinct]
    tiles = [real_tiles(v) for v in distinct]
    rows = [index[v.key] for v in visions if v is not None]
    regathered = {name: _regather(value, counts, tiles, rows) for name, value in features.items()
                  if name not in ("last_hidden_state", "hidden_states", "attentions")}
    out.pop("pixel_values")
    out["mm_encoder_outputs"] = {"image": type(features)(**regathered)}
    return out


def real_tiles(vision: PromptVision) -> int:
    """The tiles of a prompt's pixels the model encodes (Idefics3 / SmolVLM drop all-zero padding tiles)."""
    pixels = vision.tensors["pixel_values"]
    flat = pixels.reshape(-1, *pixels.shape[-3:])
    return int((flat != 0).flatten(1).any(-1).sum())


def _regather(value, counts: list[int], tiles: list[int], rows: list[int]):
    """A get_image_features output field, per distinct prompt -> per row: per-image tuples and lists (Qwen,
    LLaVA-NeXT; Qwen3-VL's DeepStack features, a list of them), or tensors whose first dimension counts images
    (Gemma 3) or encoded tiles (Idefics3)."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return [_regather(v, counts, tiles, rows) for v in value]
    if isinstance(value, (list, tuple)):
        starts = [sum(counts[:k]) for k in range(len(counts))]
        return tuple(value[starts[r] + i] for r in rows for i in range(counts[r]))
    if isinstance(value, torch.Tensor):
        units = counts if value.shape[0] == sum(counts) else tiles
        parts = torch.split(value, units)
        return torch.cat([parts[r] for r in rows])
    return value

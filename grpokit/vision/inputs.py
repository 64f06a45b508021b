"""One prompt's images as the model reads them, and several prompts' as one forward's.

    ids, vision = encode_prompt(processor, messages, template_kwargs)   # vision None for a prompt without images
    kwargs = collate([vision_a, vision_b])                               # pixel_values, image_grid_thw, ...

The processor's outputs other than `input_ids` / `attention_mask` are of two kinds (docs/vision-notes.md has every
family's): per-image or per-prompt tensors whose first dimension counts images, patches or prompts
(`pixel_values`, `image_grid_thw`, `image_sizes`, `pixel_attention_mask`), and per-token fields aligned with the
ids (`mm_token_type_ids`, Gemma 3's `token_type_ids`: 1 on image tokens). A PromptVision keeps both for one prompt,
on the CPU, plus the images themselves (for vLLM and the logs) and a content key: two rows are the same prompt when
their ids and keys are equal (image tokens alone do not tell two same-sized images apart).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

TEXT_KEYS = ("input_ids", "attention_mask")


@dataclasses.dataclass(frozen=True, eq=False)
class PromptVision:
    """tensors: {name: tensor} per-image / per-prompt processor outputs (first dimension: this prompt's images,
    patches, or 1); token_fields: {name: (P,) tensor} aligned with the prompt's P ids; images: the decoded PIL
    images; key: a digest of the tensors (same key, same images)."""

    tensors: dict[str, torch.Tensor]
    token_fields: dict[str, torch.Tensor]
    images: tuple
    key: str

    @property
    def num_images(self) -> int:
        return len(self.images)


def encode_prompt(processor, messages: list[dict], template_kwargs: dict[str, Any] | None = None
                  ) -> tuple[list[int], PromptVision | None]:
    """The prompt's ids (the chat template with an open assistant turn, each image's tokens expanded once) and its
    PromptVision (None without images), from `with_image_parts`' messages."""
    images = tuple(part["image"] for m in messages for part in m["content"] if part.get("type") == "image")
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt", **(template_kwargs or {}))
    ids = out["input_ids"]
    if not images:
        return ids[0].tolist(), None
    fields = {k: v[0] for k, v in out.items()
              if k not in TEXT_KEYS and isinstance(v, torch.Tensor) and v.shape == ids.shape}
    tensors = {k: v for k, v in out.items()
               if k not in TEXT_KEYS and k not in fields and isinstance(v, torch.Tensor)}
    return ids[0].tolist(), PromptVision(tensors, fields, images, vision_key(tensors))


def vision_key(tensors: dict[str, torch.Tensor]) -> str:
    """A digest of the tensors' names, shapes, dtypes and bytes."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def collate(visions: list[PromptVision], device=None) -> dict[str, torch.Tensor]:
    """The per-image / per-prompt tensors of several prompts (in order) as one forward takes them: concatenated
    along the first dimension, other dimensions zero-padded to the largest (LLaVA-NeXT's tiles, Idefics3's tiles
    and their masks; the models drop the padding). Prompts without images contribute nothing."""
    present = [v for v in visions if v is not None]
    if not present:
        return {}
    out = {}
    for name in present[0].tensors:
        parts = [v.tensors[name] for v in present]
        shape = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
        padded = [p if list(p.shape[1:]) == shape else _pad(p, shape) for p in parts]
        out[name] = torch.cat(padded, 0).to(device) if device is not None else torch.cat(padded, 0)
    return out


def _pad(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    out = t.new_zeros((t.shape[0], *shape))
    out[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
    return out


def token_field_rows(visions: list[PromptVision | None], names: list[str], prompt_mask: torch.Tensor,
                     extra: int = 0) -> dict[str, torch.Tensor]:
    """{name: (U, P + extra)} per-token fields of U left-padded prompts (prompt_mask (U, P)), zeros on padding and
    on the `extra` positions after the prompt (completion tokens are text). A row may be longer than the prompt its
    fields were made for (a multi-turn episode's later turn: the prompt, then earlier turns as text): the fields
    start where the row starts."""
    rows, width = prompt_mask.shape
    starts = (width - prompt_mask.sum(-1)).tolist()
    out = {}
    for name in names:
        field = torch.zeros((rows, width + extra), dtype=torch.long, device=prompt_mask.device)
        for row, vision in enumerate(visions):
            if vision is not None and name in vision.token_fields:
                values = vision.token_fields[name][: width - starts[row]]
                field[row, starts[row] : starts[row] + values.shape[0]] = values.to(field.device)
        out[name] = field
    return out

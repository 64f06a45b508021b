"""The model's side of a pass: its forward run so that it hands over last hidden states (or logits), with shared
prompts (a KV cache copied to each prompt's rows) or packed rows (no padding).

Models that transform their logits after the head (Gemma's soft-capping, Cohere's and Granite's logit scales)
cannot hand over hidden states; they take the full-logits path (`completion_logits`).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache

from grpokit.models.kv_cache import cache_kwargs, causal_lm
from grpokit.passes import packing
from grpokit.vision.inputs import collate
from grpokit.vision.model_inputs import encoded_once, forward_inputs, is_mrope, prompt_rope, rope_positions

# Config attributes of models whose forward changes the logits after the output head.
POST_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale",
                        "lm_head_multiplier")  # Falcon-H1 multiplies its logits by the last
# Attention implementations that read a custom (R, 1, L, L) mask, and whether they add it to the scores (float).
MASK_KINDS = {"sdpa": "bool", "eager": "additive"}


def distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, images: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(U,) index of the first row of each distinct (ids, mask[, images]) row, and (b,) the distinct row of every
    row; images: (b,) a number per distinct image set (`vision_ids`), since same-sized images give equal ids."""
    keys = torch.cat([prompt_ids, prompt_mask], 1)  # (b, 2P)
    if images is not None:
        keys = torch.cat([keys, images.to(keys.device, keys.dtype).unsqueeze(1)], 1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (b,)
    rows = torch.arange(keys.shape[0], device=keys.device)
    first = torch.full((int(inverse.max()) + 1,), keys.shape[0], dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # (U,)
    return first, inverse


def varlen(model) -> bool:
    """The model's attention is a flash-attention kernel (transformers' rule: "flash" in the implementation's
    name, as flash_attention_2/3/4 and the hub's flash kernels; not a paged one): it takes no custom mask but
    sequence boundaries (cu_seqlens), so a packed forward lays every sample out with its own prompt
    (`packing.unshared`) in one row."""
    name = getattr(getattr(causal_lm(model), "config", None), "_attn_implementation", None) or ""
    return "flash" in name and "paged" not in name


def packs(model) -> bool:
    """The model computes each token of a packed row as in its own padded row: it hands over hidden states
    (`output_head`), reads a custom 4D mask (sdpa or eager attention) or sequence boundaries (`varlen`), and
    attends over the whole context in every layer (a sliding window would be overridden by the mask). Multimodal
    RoPE packs too: text tokens' 1-D positions stand for all three rows, and prompts with images get their 3-D
    positions (`packed_images`)."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or output_head(model) is None:
        return False
    if getattr(config, "_attn_implementation", None) not in MASK_KINDS and not varlen(model):
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's language model
    if any(kind != "full_attention" for kind in getattr(text, "layer_types", None) or ()):
        return False
    return not (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))


def output_head(model):
    """The output head module when the model's logits are exactly head(last hidden state); None otherwise."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not hasattr(lm, "get_output_embeddings"):
        return None
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in POST_HEAD_TRANSFORMS):
        return None
    head = lm.get_output_embeddings()
    return head if isinstance(head, torch.nn.Module) else None


class _PassThrough(torch.nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def head_removed(model):
    """Inside the block, the model's forward returns last hidden states in place of logits."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    lm.set_output_embeddings(_PassThrough())
    try:
        yield
    finally:
        lm.set_output_embeddings(head)


def shared_prompt_forward(model, tokens, share_prompts: bool = True, share_images: bool = True) -> torch.Tensor:
    """(b, T, D) model outputs whose position t predicts completion token t, from `tokens` (passes.Tokens); D is
    V (logits) or H (inside `head_removed`). With share_prompts, each distinct prompt runs once, its KV cache
    copied to its rows (`reorder_cache`, whose index_select sums the rows' gradients back into the one pass): a
    prompt's images are then encoded once for all its completions. Prompts with images carry their tensors
    (grpokit.vision) into the forward that reads the prompt, and multimodal-RoPE positions into every forward;
    without shared prompts, share_images encodes each distinct prompt's images once all the same
    (`encoded_once`)."""
    prompt_ids, prompt_mask, completion_ids = tokens.prompt_ids, tokens.prompt_mask, tokens.completion_ids
    attention = torch.cat([prompt_mask, tokens.completion_mask], 1)  # (b, P + T)
    prompt_width, width = prompt_ids.shape[1], completion_ids.shape[1]
    visions = list(tokens.vision) if tokens.has_images else None
    positions = rope_positions(model, visions, prompt_ids, prompt_mask, width) if visions else None
    if positions is None:
        positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (b, P + T), else (3, b, P + T)
    first, inverse = distinct_rows(prompt_ids, prompt_mask, vision_ids(visions)) if share_prompts else (None, None)
    if first is None or first.shape[0] == prompt_ids.shape[0]:
        ids = torch.cat([prompt_ids, completion_ids], 1)
        images = {} if not visions else encoded_once(model, visions, prompt_mask, width) if share_images \
            else forward_inputs(visions, prompt_mask, width)
        return model(
            input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=width + 1,
            use_cache=False, **images,
        ).logits[:, :-1]
    cache = DynamicCache(config=getattr(causal_lm(model), "config", None))
    shared = cache_kwargs(model, cache)  # past_key_values=, or cache= where the model takes it
    images = forward_inputs([visions[i] for i in first.tolist()], prompt_mask[first]) if visions else {}
    head = model(
        input_ids=prompt_ids[first], attention_mask=prompt_mask[first],
        position_ids=positions[..., first, :prompt_width], use_cache=True, logits_to_keep=1, **shared, **images,
    ).logits  # (U, 1, D): the last prompt position predicts completion token 0
    cache.reorder_cache(inverse)  # (U, ...) -> (b, ...)
    tail = model(
        input_ids=completion_ids, attention_mask=attention, position_ids=positions[..., prompt_width:],
        use_cache=True, logits_to_keep=width, **shared,
    ).logits  # (b, T, D): completion position t predicts token t + 1
    return torch.cat([head[inverse], tail[:, :-1]], 1)


def vision_ids(visions) -> torch.Tensor | None:
    """(b,) a number per distinct image set of the rows (-1: no images), or None for a text-only batch."""
    if visions is None or all(v is None for v in visions):
        return None
    numbers: dict = {}
    return torch.tensor([-1 if v is None else numbers.setdefault(v.key, len(numbers)) for v in visions])


def packed_images(model, layout: packing.Layout, tokens) -> tuple[dict, torch.Tensor | None]:
    """What a packed forward over prompts with images takes besides ids and mask: the images' tensors in the
    order their prompts appear in the rows (row by row), the per-token fields (R, L), and for a multimodal-RoPE
    model (3, R, L) positions: each prompt's own (`prompt_rope`), its completions' p + t + the prompt's offset."""
    prompts, completions = (t.tolist() for t in packing.lengths(tokens.prompt_mask, tokens.completion_mask))
    rows, width, visions = len(layout.rows), layout.width, tokens.vision
    names = sorted({name for v in visions if v is not None for name in v.token_fields})
    fields = {name: torch.zeros((rows, width), dtype=torch.long) for name in names}
    positions = torch.zeros((3, rows, width), dtype=torch.long) if is_mrope(model) else None
    order, known, ids = [], {}, tokens.prompt_ids.cpu()
    for r, row in enumerate(layout.rows):
        at = 0
        for _, members in row:
            first, vision = members[0], visions[members[0]]
            p = prompts[first]
            order.append(vision)
            for name, field in fields.items():
                if vision is not None and name in vision.token_fields:
                    values = vision.token_fields[name][:p]
                    field[r, at : at + values.shape[0]] = values
            if positions is not None:
                prompt = ids[first, ids.shape[1] - p :]
                key = (None if vision is None else vision.key, tuple(prompt.tolist()))
                if key not in known:
                    known[key] = prompt_rope(model, prompt, vision)
                rope, delta = known[key]
                positions[:, r, at : at + p] = rope
            at += p
            for i in members:
                if positions is not None:
                    positions[:, r, at : at + completions[i]] = torch.arange(p, p + completions[i]) + delta
                at += completions[i]
    device = tokens.completion_ids.device
    return {**collate(order, device), **{k: v.to(device) for k, v in fields.items()}}, \
        None if positions is None else positions.to(device)


def packed_hidden(model, pack: packing.Pack, device, images: dict | None = None,
                  positions: torch.Tensor | None = None) -> torch.Tensor:
    """(n, H) last hidden states that predict the packed completion tokens (inside `head_removed`): the rows
    under a block-causal mask, or (`varlen`) one row whose sequence boundaries transformers hands to
    flash-attention's varlen kernel. images, positions: `packed_images`' (prompts with images)."""
    if varlen(model):
        offsets, longest = packing.boundaries(pack)
        offsets = offsets.to(device)
        attention = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest, max_length_k=longest)
    else:
        kind = MASK_KINDS[causal_lm(model).config._attn_implementation]
        dtype = None if kind == "bool" else (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(
            device.type) else causal_lm(model).dtype)
        attention = dict(attention_mask=packing.attention_mask(pack, dtype, device))
    at = pack.position_ids.to(device) if positions is None else positions
    hidden = model(input_ids=pack.input_ids.to(device), position_ids=at, use_cache=False, **attention,
                   **(images or {})).logits  # (R, L, H)
    return hidden.reshape(-1, hidden.shape[-1])[pack.source.to(device)]


def completion_logits(model, tokens, share_prompts: bool = True, share_images: bool = True) -> torch.Tensor:
    """(b, T, V) logits whose position t predicts completion token t: the full-logits path."""
    return shared_prompt_forward(model, tokens, share_prompts, share_images)

"""The log-prob passes (training, old-policy, reference): completion-token log-probs of a batch from one forward.

Two savings over "run the model on [prompt, completion] and log-softmax its logits":

1. Shared prompts. GRPO scores G completions of every prompt, so a batch holds each prompt G times. The prompt's
   keys and values do not depend on the completion (causal attention), so each distinct prompt runs once, its KV
   cache is copied to its G rows (`reorder_cache`, whose index_select sums the G rows' gradients back into the one
   prompt pass), and only the completion tokens run per row.
2. No vocabulary-sized tensor. The model runs with its output head swapped for a pass-through, so it returns last
   hidden states (b, T, H) instead of logits (b, T, V); `grpokit.algorithms.head_logprobs` then applies the head
   chunk by chunk with a recomputing backward. A head that is not a plain `nn.Linear` (a LoRA-wrapped head, say)
   goes through `module_logprobs`: the same chunks, with activation checkpointing around the module.

Both compute the same function of the weights as one full forward; only the order of floating-point operations
differs. Under FSDP2 the head's weight is a shard (a DTensor) between passes: the root unit, which owns it, is
gathered for the head pass (`_root_gathered`), its gradient reaches the gathered weight and FSDP reduce-scatters it
into the shards after the backward; a pass without backward leaves the resharding to its caller.

3. No padding (`grpokit.packing`). Where the model takes a custom attention mask (`packs`), the samples are laid
   end to end in rows with a block-causal mask, each distinct prompt once per row: no token is computed for
   padding, the shared prompts run once in the one forward (so also under DDP with gradients, gradient
   checkpointing and FSDP, where a second forward before the backward is not possible), and the head runs on the
   completion tokens only. A flash-attention model (`varlen`) takes sequence boundaries instead of a mask: its
   samples go end to end in one row, each with its own prompt, and transformers passes the boundaries to
   flash-attention's varlen kernel. Other models take the padded path of 1.

Models that transform their logits after the head (Gemma's soft-capping, Cohere's and Granite's logit scales)
cannot hand over hidden states this way; they take the full-logits path (`completion_logits`).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from grpokit import packing
from grpokit.algorithms import head_logprobs, head_token_loss, token_entropy, token_logprobs
from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, NO_GRAD_CHUNK_ELEMENTS, chunk_rows
from grpokit.kv_cache import cache_kwargs, causal_lm

logger = logging.getLogger("grpokit")

# Config attributes of models whose forward changes the logits after the output head.
POST_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def distinct_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(U,) index of the first row of each distinct (ids, mask) row, and (b,) the distinct row of every row."""
    keys = torch.cat([prompt_ids, prompt_mask], 1)  # (b, 2P)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)  # (b,)
    rows = torch.arange(keys.shape[0], device=keys.device)
    first = torch.full((int(inverse.max()) + 1,), keys.shape[0], dtype=torch.long, device=keys.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # (U,)
    return first, inverse


# Attention implementations that read a custom (R, 1, L, L) mask, and whether they add it to the scores (float).
MASK_KINDS = {"sdpa": "bool", "eager": "additive"}


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
    attends over the whole context in every layer (a sliding window would be overridden by the mask)."""
    lm = causal_lm(model)
    config = getattr(lm, "config", None)
    if config is None or output_head(model) is None:
        return False
    if getattr(config, "_attn_implementation", None) not in MASK_KINDS and not varlen(model):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return not getattr(config, "rope_scaling", None) or "mrope_section" not in (config.rope_scaling or {})


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
def _head_removed(model):
    """Inside the block, the model's forward returns last hidden states in place of logits."""
    lm = causal_lm(model)
    head = lm.get_output_embeddings()
    lm.set_output_embeddings(_PassThrough())
    try:
        yield
    finally:
        lm.set_output_embeddings(head)


def _root_gathered(model) -> None:
    """FSDP2: gather the root unit's weights (embeddings, final norm, output head) for the head pass. Its forward
    has gathered them already and FSDP keeps the root gathered until the backward, so this is a no-op today; it
    makes the head pass independent of that choice."""
    if isinstance(model, FSDPModule):
        model.unshard()


def shared_prompt_forward(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, share_prompts: bool = True,
) -> torch.Tensor:
    """(b, T, D) model outputs whose position t predicts completion token t, from (b, P) left-padded prompts and
    (b, T) right-padded completions; D is V (logits) or H (inside `_head_removed`). With share_prompts, each
    distinct prompt runs once (see the module doc)."""
    attention = torch.cat([prompt_mask, completion_mask], 1)  # (b, P + T)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    prompt_width, width = prompt_ids.shape[1], completion_ids.shape[1]
    first, inverse = distinct_rows(prompt_ids, prompt_mask) if share_prompts else (None, None)
    if first is None or first.shape[0] == prompt_ids.shape[0]:
        ids = torch.cat([prompt_ids, completion_ids], 1)
        return model(
            input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=width + 1, use_cache=False
        ).logits[:, :-1]
    cache = DynamicCache(config=getattr(causal_lm(model), "config", None))
    shared = cache_kwargs(model, cache)  # past_key_values=, or cache= where the model takes it
    head = model(
        input_ids=prompt_ids[first], attention_mask=prompt_mask[first], position_ids=positions[first, :prompt_width],
        use_cache=True, logits_to_keep=1, **shared,
    ).logits  # (U, 1, D): the last prompt position predicts completion token 0
    cache.reorder_cache(inverse)  # (U, ...) -> (b, ...)
    tail = model(
        input_ids=completion_ids, attention_mask=attention, position_ids=positions[:, prompt_width:],
        use_cache=True, logits_to_keep=width, **shared,
    ).logits  # (b, T, D): completion position t predicts token t + 1
    return torch.cat([head[inverse], tail[:, :-1]], 1)


def packed_hidden(model, pack: packing.Pack, device) -> torch.Tensor:
    """(n, H) last hidden states that predict the packed completion tokens (inside `_head_removed`): the rows
    under a block-causal mask, or (`varlen`) one row whose sequence boundaries transformers hands to
    flash-attention's varlen kernel."""
    if varlen(model):
        offsets, longest = packing.boundaries(pack)
        offsets = offsets.to(device)
        attention = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=longest, max_length_k=longest)
    else:
        kind = MASK_KINDS[causal_lm(model).config._attn_implementation]
        dtype = None if kind == "bool" else (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(
            device.type) else causal_lm(model).dtype)
        attention = dict(attention_mask=packing.attention_mask(pack, dtype, device))
    hidden = model(input_ids=pack.input_ids.to(device), position_ids=pack.position_ids.to(device), use_cache=False,
                   **attention).logits  # (R, L, H)
    return hidden.reshape(-1, hidden.shape[-1])[pack.source.to(device)]


def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts=True):
    """(b, T, V) logits whose position t predicts completion token t: the full-logits path."""
    return shared_prompt_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)


def module_logprobs(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, temperature: float, with_entropy: bool,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`head_logprobs` for any head module (LoRA-wrapped, quantised): (b, T, H) -> (b, T) log-probs, entropies.

    Chunks over positions with activation checkpointing, so one chunk's logits exist at a time, in the forward
    and again in the backward."""
    flat_hidden, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1, 1)
    rows = chunk_rows(getattr(head, "out_features", None) or head.weight.shape[0], chunk_elements)

    def chunk(h, y):  # one head pass gives both; the entropy has a gradient only when entropy_grad
        logits = head(h).unsqueeze(0)  # (1, C, V)
        entropy = token_entropy(logits, temperature, differentiable=entropy_grad).squeeze(0) if with_entropy else h.new_empty(0)
        return token_logprobs(logits, y.T, temperature).squeeze(0), entropy

    logps, entropies = [], []
    for start in range(0, flat_hidden.shape[0], rows):
        h, y = flat_hidden[start : start + rows], flat_targets[start : start + rows]
        logp, entropy = checkpoint(chunk, h, y, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, y)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).reshape(targets.shape)
    return logp, (torch.cat(entropies).reshape(targets.shape) if with_entropy else None)


def completion_logprobs(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False, share_prompts: bool = True,
    chunk_elements: int | None = None, entropy_grad: bool = False, pack: bool = True,
    layout: packing.Layout | None = None, token_loss=None, into_grad: bool = False,
) -> tuple:
    """(b, T) float32 log-probs of the completion tokens under softmax(logits / temperature), and their entropies
    when asked; the log-probs are differentiable with respect to the model's weights, the entropies too when
    entropy_grad (an entropy bonus). Inputs as in `shared_prompt_forward`. pack: the padding-free forward where the
    model `packs` (each prompt then runs once per row whatever share_prompts says: it is one forward; with a flash
    attention, once per sample, `varlen`), in the rows of `layout` (None: `packing.plan`'s), when they forward at
    most PACK_WHEN of the padded pass's positions.

    token_loss(logp (n,), entropy (n,) or None, rows (n,), cols (n,)) -> (): a loss that sums functions of each
    completion token's log-prob (and entropy: differentiable only with entropy_grad), given the tokens at (rows,
    cols) of (b, T); then the result is (loss, log-probs, entropies) with the log-probs and entropies detached,
    and with a plain linear head the head's gradients are computed in its forward (`algorithms.head_token_loss`:
    3 head matmuls per token instead of 4; into_grad: dL/dW summed straight into the head weight's `.grad`, as
    `head_token_loss` says, with its conditions). chunk_elements: the most logits that exist at once (None:
    DEFAULT_CHUNK_ELEMENTS with gradients, NO_GRAD_CHUNK_ELEMENTS without)."""
    if chunk_elements is None:
        chunk_elements = DEFAULT_CHUNK_ELEMENTS if torch.is_grad_enabled() else NO_GRAD_CHUNK_ELEMENTS
    head = output_head(model)
    if pack and packs(model) and packing.packable(prompt_mask, completion_mask):
        first, inverse = distinct_rows(prompt_ids, prompt_mask)
        prompts, completions = (t.tolist() for t in packing.lengths(prompt_mask, completion_mask))
        if varlen(model):
            order = range(len(prompts)) if layout is None else [i for row in layout.rows for _, m in row for i in m]
            layout = packing.unshared(list(order), inverse.tolist(), prompts, completions)
        elif layout is None:
            layout = packing.plan(inverse.tolist(), prompts, completions, packing.row_tokens(causal_lm(model).config))
        padded = padded_positions(prompt_mask, completion_mask, first.shape[0] if share_prompts else None)
        if len(layout.rows) * layout.width <= PACK_WHEN * padded:
            return packed_logprobs(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                   temperature, with_entropy, chunk_elements, entropy_grad, layout, token_loss,
                                   into_grad)
    if token_loss is not None and head is not None:  # the head on the counted positions only, then the loss
        with _head_removed(model):
            hidden = shared_prompt_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                           share_prompts)
        _root_gathered(model)
        rows, cols = completion_mask.bool().nonzero(as_tuple=True)
        return _head_loss(head, hidden[rows, cols], rows, cols, completion_ids, temperature, with_entropy,
                          chunk_elements, token_loss, into_grad, entropy_grad)
    if token_loss is not None:
        logp, entropy = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                            temperature, with_entropy, share_prompts, chunk_elements, entropy_grad,
                                            pack=False)
        rows, cols = completion_mask.bool().nonzero(as_tuple=True)
        loss = token_loss(logp[rows, cols], None if entropy is None else entropy[rows, cols], rows, cols)
        return loss, logp.detach(), None if entropy is None else entropy.detach()
    if head is None:
        logits = completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)
        logp = token_logprobs(logits, completion_ids, temperature, chunk_elements)
        return logp, (token_entropy(logits, temperature, chunk_elements, entropy_grad) if with_entropy else None)
    with _head_removed(model):
        hidden = shared_prompt_forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, share_prompts)
    _root_gathered(model)
    if type(head) is torch.nn.Linear:
        return head_logprobs(
            hidden, head.weight, head.bias, completion_ids, temperature, with_entropy, chunk_elements, entropy_grad
        )
    return module_logprobs(hidden, head, completion_ids, temperature, with_entropy, chunk_elements, entropy_grad)


# Pack a forward when its rows x width is at most this fraction of the padded pass's positions: above that the
# padded pass (a few rows of nearly equal length, prompts shared through the KV cache) is as cheap, and packing's
# bookkeeping is not worth it. The same rule for a token-budgeted forward's layout (its positions padded are then
# at most budget / PACK_WHEN).
PACK_WHEN = 0.8


def padded_positions(prompt_mask, completion_mask, distinct: int | None) -> int:
    """Positions the padded pass forwards: U x P + b x T with the U `distinct` prompts shared, b x (P + T) when
    prompts are not shared (None)."""
    b, width = completion_mask.shape[0], int(completion_mask.sum(-1).max())
    prompt_width = int(prompt_mask.sum(-1).max())
    return (b if distinct is None else distinct) * prompt_width + b * width


def _flat_logprobs(head, hidden, targets, temperature, with_entropy, chunk_elements, entropy_grad):
    """(n,) log-probs and entropies of the hidden states (n, H) that predict `targets` (n,), through the head."""
    if type(head) is torch.nn.Linear:
        return head_logprobs(hidden, head.weight, head.bias, targets, temperature, with_entropy, chunk_elements,
                             entropy_grad)
    logp, entropy = module_logprobs(hidden.unsqueeze(0), head, targets.unsqueeze(0), temperature, with_entropy,
                                    chunk_elements, entropy_grad)
    return logp.squeeze(0), (entropy.squeeze(0) if with_entropy else None)


def _grid(values, rows, cols, shape):
    """(n,) per-token values -> (b, T) at (rows, cols), zeros elsewhere (differentiable); None stays None."""
    return None if values is None else values.new_zeros(shape).index_put((rows, cols), values)


def _head_loss(head, hidden, rows, cols, completion_ids, temperature, with_entropy, chunk_elements, token_loss,
               into_grad=False, entropy_grad=True):
    """(loss, (b, T) log-probs, entropies) of the hidden states (n, H) that predict completion tokens (rows,
    cols): the loss inside the head's chunks for a plain linear head (`head_token_loss`), else after it."""
    targets = completion_ids[rows, cols]  # (n,)
    if type(head) is torch.nn.Linear:
        loss, logp, entropy = head_token_loss(
            hidden, head.weight, head.bias, targets, lambda x, e, part: token_loss(x, e, rows[part], cols[part]),
            temperature, with_entropy, chunk_elements, into_grad, entropy_grad)
    else:
        logp, entropy = _flat_logprobs(head, hidden, targets, temperature, with_entropy, chunk_elements, entropy_grad)
        loss = token_loss(logp, entropy, rows, cols)
        logp, entropy = logp.detach(), (None if entropy is None else entropy.detach())
    shape = tuple(completion_ids.shape)
    return loss, _grid(logp, rows, cols, shape), _grid(entropy, rows, cols, shape)


def packed_logprobs(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature, with_entropy,
                    chunk_elements, entropy_grad, layout, token_loss=None, into_grad=False):
    """`completion_logprobs` through one padding-free forward in the rows of `layout` (grpokit.packing): the same
    values, (b, T) each (with token_loss: the loss first)."""
    pack = packing.build(layout, prompt_ids, prompt_mask, completion_ids, completion_mask)
    device = completion_ids.device
    with _head_removed(model):
        hidden = packed_hidden(model, pack, device)  # (n, H)
    _root_gathered(model)
    rows, cols = pack.sample.to(device), pack.offset.to(device)
    if token_loss is not None:
        return _head_loss(head, hidden, rows, cols, completion_ids, temperature, with_entropy, chunk_elements,
                          token_loss, into_grad, entropy_grad)
    logp, entropy = _flat_logprobs(head, hidden, completion_ids[rows, cols], temperature, with_entropy,
                                   chunk_elements, entropy_grad)
    shape = tuple(completion_ids.shape)
    return _grid(logp, rows, cols, shape), _grid(entropy, rows, cols, shape)

"""`run_pass`: one function picks the path of a log-prob pass, and each path is one function.

    result = run_pass(model, tokens, PassRequest(temperature=0.7, entropy=True))   # PassResult

Paths, in the order they are tried:
- packed (`packed_pass`): the model packs (sdpa / eager attention, or flash attention's boundaries), the request
  allows it, and the packed rows forward at most PACK_WHEN of the padded pass's positions;
- padded (`padded_pass`): hidden states (b, T, H), each distinct prompt once through a shared KV cache where the
  request allows it, then the head on every position (or, with a loss, on the completion tokens only);
- logits (`logits_pass`): a model that transforms its logits after the head: full (b, T, V) logits.
All compute the same function of the weights; only the order of floating-point operations differs.
"""

from __future__ import annotations

import torch

from grpokit.algorithms import token_entropy, token_logprobs
from grpokit.models.kv_cache import causal_lm
from grpokit.passes import packing
from grpokit.passes.forward import (completion_logits, distinct_rows, head_removed, output_head, packed_hidden,
                                    packed_images, packs, shared_prompt_forward, varlen, vision_ids)
from grpokit.passes.heads import flat_logprobs, grid, head_loss
from grpokit.passes.request import PassRequest, PassResult, Tokens

# Pack a forward when its rows x width is at most this fraction of the padded pass's positions: above that the
# padded pass (a few rows of nearly equal length, prompts shared through the KV cache) is as cheap, and packing's
# bookkeeping is not worth it. The same rule for a token-budgeted forward's layout (its positions padded are then
# at most budget / PACK_WHEN).
PACK_WHEN = 0.8


def run_pass(model, tokens: Tokens, request: PassRequest) -> PassResult:
    """The completion tokens' log-probs (entropies, loss) of `tokens` through `model`, as `request` asks."""
    request = request.resolved()
    head = output_head(model)
    layout = packed_layout(model, tokens, request)
    if layout is not None:
        return packed_pass(model, head, tokens, request, layout)
    if head is None:
        return logits_pass(model, tokens, request)
    return padded_pass(model, head, tokens, request)


def packed_layout(model, tokens: Tokens, request: PassRequest) -> packing.Layout | None:
    """The packed rows this pass runs in, or None for the padded path: the request's layout (flash attention:
    re-laid with a prompt per sample) or `packing.plan`'s, when they forward at most PACK_WHEN of the padded
    pass's positions."""
    if not (request.pack and packs(model) and packing.packable(tokens.prompt_mask, tokens.completion_mask)):
        return None
    if tokens.has_images and varlen(model):  # a prompt per sample there: images shared on the padded path
        return None
    first, inverse = distinct_rows(tokens.prompt_ids, tokens.prompt_mask,
                                   vision_ids(list(tokens.vision)) if tokens.has_images else None)
    prompts, completions = (t.tolist() for t in packing.lengths(tokens.prompt_mask, tokens.completion_mask))
    layout = request.layout
    if varlen(model):
        order = range(len(prompts)) if layout is None else [i for row in layout.rows for _, m in row for i in m]
        layout = packing.unshared(list(order), inverse.tolist(), prompts, completions)
    elif layout is None:
        layout = packing.plan(inverse.tolist(), prompts, completions, packing.row_tokens(causal_lm(model).config))
    padded = padded_positions(tokens.prompt_mask, tokens.completion_mask,
                              first.shape[0] if request.share_prompts else None)
    return layout if len(layout.rows) * layout.width <= PACK_WHEN * padded else None


def padded_positions(prompt_mask, completion_mask, distinct: int | None) -> int:
    """Positions the padded pass forwards: U x P + b x T with the U `distinct` prompts shared, b x (P + T) when
    prompts are not shared (None)."""
    b, width = completion_mask.shape[0], int(completion_mask.sum(-1).max())
    prompt_width = int(prompt_mask.sum(-1).max())
    return (b if distinct is None else distinct) * prompt_width + b * width


def packed_pass(model, head, tokens: Tokens, request: PassRequest, layout: packing.Layout) -> PassResult:
    """One padding-free forward in the rows of `layout` (grpokit.passes.packing), the head on the completion
    tokens only."""
    pack = packing.build(layout, tokens.prompt_ids, tokens.prompt_mask, tokens.completion_ids,
                         tokens.completion_mask)
    device = tokens.completion_ids.device
    images, positions = packed_images(model, layout, tokens) if tokens.has_images else ({}, None)
    with head_removed(model):
        hidden = packed_hidden(model, pack, device, images, positions)  # (n, H)
    return _on_tokens(head, hidden, pack.sample.to(device), pack.offset.to(device), tokens, request)


def padded_pass(model, head, tokens: Tokens, request: PassRequest) -> PassResult:
    """Hidden states (b, T, H) of the padded rows; the head on every position, or with a loss on the completion
    tokens only."""
    with head_removed(model):
        hidden = shared_prompt_forward(model, tokens, request.share_prompts, request.share_images)
    if request.token_loss is not None:
        rows, cols = tokens.completion_mask.bool().nonzero(as_tuple=True)
        return _on_tokens(head, hidden[rows, cols], rows, cols, tokens, request)
    targets = tokens.completion_ids
    logp, entropy = flat_logprobs(head, hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), request)
    return PassResult(logp.reshape(targets.shape), None if entropy is None else entropy.reshape(targets.shape))


def logits_pass(model, tokens: Tokens, request: PassRequest) -> PassResult:
    """Full (b, T, V) logits (a model that transforms them after its head), then the log-probs, entropies and
    loss from them."""
    logits = completion_logits(model, tokens, request.share_prompts, request.share_images)
    logp = token_logprobs(logits, tokens.completion_ids, request.temperature, request.chunk_elements)
    entropy = token_entropy(logits, request.temperature, request.chunk_elements, request.entropy_grad) \
        if request.entropy else None
    if request.token_loss is None:
        return PassResult(logp, entropy)
    rows, cols = tokens.completion_mask.bool().nonzero(as_tuple=True)
    loss = request.token_loss(logp[rows, cols], None if entropy is None else entropy[rows, cols], rows, cols)
    return PassResult(logp.detach(), None if entropy is None else entropy.detach(), loss)


def _on_tokens(head, hidden, rows, cols, tokens: Tokens, request: PassRequest) -> PassResult:
    """The head on the hidden states (n, H) of the completion tokens at (rows, cols), laid out as (b, T)."""
    shape = tuple(tokens.completion_ids.shape)
    targets = tokens.completion_ids[rows, cols]
    if request.token_loss is not None:
        loss, logp, entropy = head_loss(head, hidden, targets, rows, cols, request)
        return PassResult(grid(logp, rows, cols, shape), grid(entropy, rows, cols, shape), loss)
    logp, entropy = flat_logprobs(head, hidden, targets, request)
    return PassResult(grid(logp, rows, cols, shape), grid(entropy, rows, cols, shape))


def completion_logprobs(
    model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
    completion_mask: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False, share_prompts: bool = True,
    chunk_elements: int | None = None, entropy_grad: bool = False, pack: bool = True,
    layout: packing.Layout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(b, T) float32 log-probs of the completion tokens under softmax(logits / temperature) and their entropies
    (None unless with_entropy): `run_pass` for callers with the four tensors at hand. Differentiable with respect
    to the model's weights (the entropies too with entropy_grad)."""
    tokens = Tokens(prompt_ids, prompt_mask, completion_ids, completion_mask)
    request = PassRequest(temperature, with_entropy, entropy_grad, chunk_elements, pack=pack,
                          share_prompts=share_prompts, layout=layout)
    result = run_pass(model, tokens, request)
    return result.logprobs, result.entropies

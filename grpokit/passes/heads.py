"""The head's side of a pass: log-probs, entropies and (when asked) the loss from last hidden states, never with
more than one chunk of logits at a time.

A plain `nn.Linear` head goes through `algorithms.head_logprobs` (a recomputing backward) or, with a loss in the
pass, `algorithms.head_token_loss` (the head's gradients in its forward: 3 head matmuls per token instead of 4).
Any other head module (LoRA-wrapped, quantised) goes through `module_logprobs`: the same chunks, with activation
checkpointing around the module.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from grpokit.algorithms import head_logprobs, head_token_loss, token_entropy, token_logprobs
from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, chunk_rows


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
        entropy = token_entropy(logits, temperature, differentiable=entropy_grad).squeeze(0) if with_entropy \
            else h.new_empty(0)
        return token_logprobs(logits, y.T, temperature).squeeze(0), entropy

    logps, entropies = [], []
    for start in range(0, flat_hidden.shape[0], rows):
        h, y = flat_hidden[start : start + rows], flat_targets[start : start + rows]
        logp, entropy = checkpoint(chunk, h, y, use_reentrant=False) if torch.is_grad_enabled() else chunk(h, y)
        logps.append(logp)
        entropies.append(entropy)
    logp = torch.cat(logps).reshape(targets.shape)
    return logp, (torch.cat(entropies).reshape(targets.shape) if with_entropy else None)


def flat_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, request) -> tuple:
    """(n,) log-probs and entropies (or None) of the hidden states (n, H) that predict `targets` (n,)."""
    if type(head) is torch.nn.Linear:
        return head_logprobs(hidden, head.weight, head.bias, targets, request.temperature, request.entropy,
                             request.chunk_elements, request.entropy_grad)
    logp, entropy = module_logprobs(hidden.unsqueeze(0), head, targets.unsqueeze(0), request.temperature,
                                    request.entropy, request.chunk_elements, request.entropy_grad)
    return logp.squeeze(0), (entropy.squeeze(0) if request.entropy else None)


def head_loss(head, hidden: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
              request) -> tuple:
    """(loss, (n,) log-probs, (n,) entropies or None), both detached, of the hidden states (n, H) that predict
    `targets`, the completion tokens at (rows, cols): the request's token_loss inside the head's chunks for a
    plain linear head (`head_token_loss`), else after the head."""
    token_loss = request.token_loss
    if type(head) is torch.nn.Linear:
        return head_token_loss(
            hidden, head.weight, head.bias, targets, lambda x, e, part: token_loss(x, e, rows[part], cols[part]),
            request.temperature, request.entropy, request.chunk_elements, request.into_grad, request.entropy_grad)
    logp, entropy = flat_logprobs(head, hidden, targets, request)
    loss = token_loss(logp, entropy, rows, cols)
    return loss, logp.detach(), (None if entropy is None else entropy.detach())


def grid(values: torch.Tensor | None, rows: torch.Tensor, cols: torch.Tensor, shape) -> torch.Tensor | None:
    """(n,) per-token values -> (b, T) at (rows, cols), zeros elsewhere (differentiable); None stays None."""
    return None if values is None else values.new_zeros(shape).index_put((rows, cols), values)

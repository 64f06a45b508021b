"""Log-probs and entropies of chosen tokens straight from the last hidden states: the LM head fused in, in chunks.

At a real vocabulary the (B, T, V) logits dwarf everything else in a GRPO step: 16 completions x 256 tokens x
151,936 entries is 2.5 GB in fp32, and the unfused path holds the logits, their log-softmax and the gradient of
each. Here no such tensor ever exists. The N = B*T positions are cut into chunks of C rows; for each chunk

    z = (h W^T + b) / tau                                    (C, V), the only vocabulary-sized tensor, freed at once
    lse = logsumexp_v z                                      (C,)   kept for the backward (fp32)
    log pi(y) = z[y] - lse
    H = lse - sum_v softmax(z)_v z_v                         (entropy; a metric, or a loss term: entropy_coef)

and the backward recomputes each chunk's z from the saved hidden states instead of storing it. With the upstream
gradient g = dL/dlog pi(y) (one number per position),

    dL/dz = g * (onehot(y) - softmax(z)),   dL/dh = (dL/dz) W / tau,   dL/dW = (dL/dz)^T h / tau,   dL/db = sum (dL/dz) / tau.

and when the entropy has an upstream gradient g_H too (an entropy bonus), dL/dz gains
g_H * dH/dz = -g_H * p * (log p + H), with p = softmax(z) and log p = z - lse.

Cost: the head's matmul runs once in the forward and three times in the backward (recompute, dL/dh, dL/dW),
against once and twice unfused, in exchange for memory that no longer grows with V x N. Softmax, logsumexp and the
entropy accumulate in fp32 whatever the model's dtype (bf16 matmuls, fp32 normaliser).
"""

from __future__ import annotations

import torch

from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, chunk_rows


def _chunk_logits(hidden, weight, bias, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """(C, V) tempered logits of one chunk of hidden states (C, H), in `out`'s dtype (fp32, or fp64 for fp64
    inputs). The matmul runs in the inputs' dtype, or in autocast's dtype when autocast is on; where no cast is
    needed it writes straight into `out`, a buffer reused across chunks (a fresh (C, V) tensor per chunk costs as
    much in page faults as the matmul itself on a CPU)."""
    rows = hidden.shape[0]
    logits = out[:rows]
    device = hidden.device.type
    if hidden.dtype == weight.dtype == out.dtype and not torch.is_autocast_enabled(device):
        torch.mm(hidden, weight.t(), out=logits)
        if bias is not None:
            logits.add_(bias)
    else:
        logits.copy_(torch.nn.functional.linear(hidden, weight, bias))
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


class _HeadLogProbs(torch.autograd.Function):
    """Autograd function behind `head_logprobs`; see the module doc for the formulas."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, with_entropy, entropy_grad):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = hidden.new_empty(hidden.shape[0], dtype=dtype)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        rows = max(1, min(rows, hidden.shape[0]))
        logits_buffer = hidden.new_empty((rows, weight.shape[0]), dtype=dtype)
        exp_buffer = torch.empty_like(logits_buffer)
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            logits = _chunk_logits(hidden[part], weight, bias, temperature, logits_buffer)  # (C, V)
            top = logits.amax(-1, keepdim=True)  # (C, 1)
            shifted = torch.sub(logits, top, out=exp_buffer[: logits.shape[0]]).exp_()  # exp(z - max)
            total = shifted.sum(-1)  # (C,)
            lse[part] = top.squeeze(-1) + total.log()
            logp[part] = logits.gather(-1, targets[part].unsqueeze(-1)).squeeze(-1) - lse[part]
            if with_entropy:  # H = lse - sum_v p_v z_v, with p_v = e_v / total
                entropy[part] = lse[part] - shifted.mul_(logits).sum(-1) / total
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        device = hidden.device.type  # the backward recomputes the logits under the forward's autocast state
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: no work for it
        if with_entropy and not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        device, enabled, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            return _HeadLogProbs._backward(ctx, grad_logp, grad_entropy, mixed=enabled)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy, mixed: bool):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        dtype = lse.dtype  # fp32 (fp64 for fp64 inputs): gradients of the head accumulate at this precision
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_b else None
        buffer = hidden.new_empty((ctx.rows, weight.shape[0]), dtype=dtype)
        scale = 1.0 / ctx.temperature
        for start in range(0, hidden.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            g = grad_logp[part].to(dtype).unsqueeze(-1) * scale  # (C, 1)
            # dL/dz = g * (onehot(y) - softmax(z)) / tau, built in place in the recomputed logits
            grad_z = _chunk_logits(hidden[part], weight, bias, ctx.temperature, buffer)
            grad_z.sub_(lse[part].unsqueeze(-1))  # log p
            entropy_term = None
            if grad_entropy is not None:  # -g_H p (log p + H) / tau
                g_h = grad_entropy[part].to(dtype).unsqueeze(-1) * scale
                entropy_term = (grad_z + entropy[part].unsqueeze(-1)).mul_(grad_z.exp()).mul_(g_h)
            grad_z.exp_().mul_(-g)
            if entropy_term is not None:
                grad_z.sub_(entropy_term)
            grad_z.scatter_add_(-1, targets[part].unsqueeze(-1), g)  # (C, V)
            if need_h:
                grad_h[part] = torch.mm(grad_z.to(weight.dtype), weight).to(hidden.dtype)
            if need_w and mixed:  # the matmul in the autocast dtype, the sum over chunks in fp32
                grad_w += torch.mm(grad_z.T, hidden[part])
            elif need_w:
                grad_w.addmm_(grad_z.T, hidden[part].to(dtype))
            if need_b:
                grad_b += grad_z.sum(0)
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((h W^T + b) / tau)[y] at every position, and the entropy of that distribution if asked.

    Equal to `token_logprobs(linear(hidden, weight, bias), targets, temperature)` (values and gradients with
    respect to hidden, weight and bias), without ever holding more than one chunk of logits.

    Args:
        hidden: (..., H) last hidden states; position t predicts targets[..., t].
        weight: (V, H) output projection (the tied embedding matrix for tied models); bias: (V,) or None.
        targets: (...) integer token ids, same leading shape as hidden.
        temperature: tau > 0, the rollout's sampling temperature.
        with_entropy: also return the entropy (nats) at every position.
        entropy_grad: the entropy is differentiable too (an entropy bonus); else a metric without gradient.
        chunk_elements: at most this many logits exist at once.
    Returns:
        (...) float32 log-probs (differentiable) and (...) float32 entropies or None (float64 for float64 inputs).
    """
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (N, H)
    flat_targets = targets.reshape(-1).long()  # (N,)
    rows = chunk_rows(weight.shape[0], chunk_elements)
    logp, entropy = _HeadLogProbs.apply(
        flat_hidden, weight, bias, flat_targets, float(temperature), rows, with_entropy, entropy_grad
    )
    return logp.reshape(shape), (entropy.reshape(shape) if entropy is not None else None)

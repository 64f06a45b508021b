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
against once and twice unfused, in exchange for memory that no longer grows with V x N. When the loss is a sum of
per-token functions of each token's log-prob (`head_token_loss`: token-level objectives), g is known as soon as a
chunk's log-probs are, so the forward computes dL/dz, dL/dh and dL/dW while the chunk's logits are at hand, and
the backward only scales them: three matmuls per token, as unfused, with the fused head's memory. Softmax,
logsumexp and the entropy accumulate in fp32 whatever the model's dtype (bf16 matmuls, fp32 normaliser).

Memory and passes per chunk: the statistics work on a block of ~13 rows at a time (a cache-sized exp buffer; bf16
products widened block by block, so a no-grad pass holds no fp32 (C, V) logits); in the loss-in-the-forward path
without an entropy gradient each block's softmax replaces its logits (dL/dz is then one pass); on a CPU a bf16
product shares the fp32 buffer's bytes and dL/dz is narrowed in place; and dL/dW can be summed straight into the
weight's gradient (`into_grad`).
"""

from __future__ import annotations

import torch

from grpokit.algorithms.head_buffers import forward_buffers, narrow_in_place, scratch as scratch_buffer, stats_buffers
from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, chunk_rows


def _operands(hidden, weight, bias):
    """The head's matmul operands, cast once per pass to autocast's dtype when autocast is on (casting inside
    each chunk's matmul would convert the whole (V, H) weight once per chunk), else as they are."""
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _chunk_logits(hidden, weight, bias, temperature: float, out: torch.Tensor, scratch) -> torch.Tensor:
    """(C, V) tempered logits of one chunk of hidden states (C, H), in `out`'s dtype (fp32, or fp64 for fp64
    inputs). The matmul runs in the operands' dtype (`_operands`); where that is `out`'s it writes straight into
    `out`, a buffer reused across chunks (a fresh (C, V) tensor per chunk costs as much in page faults as the
    matmul itself on a CPU), else into `scratch` (`head_buffers.scratch`: the same rows in the operands' dtype), then `out`."""
    logits = out[: hidden.shape[0]]
    product = _product(hidden, weight, logits if weight.dtype == out.dtype else scratch)
    if product is not logits:
        logits.copy_(product)
    if bias is not None:
        logits.add_(bias)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def _product(hidden, weight, out: torch.Tensor) -> torch.Tensor:
    """(c, V) = hidden (c, H) @ weight^T (V, H), autocast off, into out[:c] (rows of a (C, V) buffer in the
    operands' dtype): the chunk's logits before bias and temperature, which `_chunk_stats` applies."""
    with torch.autocast(hidden.device.type, enabled=False):
        return torch.mm(hidden, weight.t(), out=out[: hidden.shape[0]])


# exp's arguments are clamped at this floor: exp(-87) = 1.6e-38, the smallest normal fp32 number is 1.2e-38. Below,
# exp returns denormals (or 0 through them), which x86 CPUs compute 5-9x slower (a chunk of the real vocabulary:
# 10 ms when every exponent is above -80, 54 ms in [-100, 0], 90 ms in [-150, 0]; `python
# benchmarks/head_matmul.py`). A trained model's logits can spread that far (temperature < 1 widens them); a
# clamped entry adds at most 1.6e-38 where the sums are at least 1, below fp32's resolution.
EXP_FLOOR = -87.0


def _chunk_stats(source, buffers, targets, part: slice, lse, logp, entropy, bias=None, temperature: float = 1.0,
                 probs: torch.Tensor | None = None, keep: bool = False) -> None:
    """Write one chunk's lse, log pi(y) and (entropy not None) H into those (N,) tensors at `part`, from its
    (C, V) products `source` (`_product`: before bias and temperature), a block of rows at a time: its logits z =
    (product + bias) / tau (in place in an fp32 source, else widened into `buffers`' second, as `_chunk_logits`
    makes them), then e = exp(z - max) in the first. keep: the source is left holding the logits z; probs (C, V):
    p = softmax(z) = e / sum_v e_v is written there (the forward's dL/dz is then one pass over the chunk,
    `_logit_grads`, instead of four); else the source is spent."""
    exps, wide = buffers
    start = part.start
    for first in range(0, source.shape[0], exps.shape[0]):
        block = source[first : first + exps.shape[0]]  # (c, V)
        rows = slice(start + first, start + first + block.shape[0])
        z = block if wide is None or block.dtype == exps.dtype else wide[: block.shape[0]].copy_(block)
        if bias is not None:
            z.add_(bias)
        if temperature != 1.0:
            z.div_(temperature)
        top = z.amax(-1, keepdim=True)  # (c, 1)
        shifted = torch.sub(z, top, out=exps[: z.shape[0]]).clamp_(min=EXP_FLOOR).exp_()  # exp(z - max)
        total = shifted.sum(-1)  # (c,)
        lse[rows] = top.squeeze(-1) + total.log()
        logp[rows] = z.gather(-1, targets[rows].unsqueeze(-1)).squeeze(-1) - lse[rows]
        if entropy is not None:  # H = lse - sum_v p_v z_v, with p_v = e_v / total
            weighted = shifted.mul_(z) if keep else z.mul_(shifted)  # e z, in whichever may be overwritten
            entropy[rows] = lse[rows] - weighted.sum(-1) / total
        if probs is not None:
            torch.div(shifted, total.unsqueeze(-1), out=probs[first : first + block.shape[0]])


def _logit_grads(logits, lse, entropy, g_logp, g_entropy, targets, scale: float, part: slice,
                 probs: bool = False) -> torch.Tensor:
    """dL/dz of one chunk, built in place in its (C, V) tempered logits z: g (onehot(y) - p) / tau, and
    - g_H p (log p + H) / tau when the entropy has an upstream gradient g_H. lse, g: (C,); entropy: all (N,).
    probs: the buffer holds p = softmax(z) already (`_chunk_stats`' probs; no entropy gradient then)."""
    dtype = logits.dtype
    g = g_logp.to(dtype).unsqueeze(-1) * scale  # (C, 1)
    if probs:
        return logits.mul_(-g).scatter_add_(-1, targets.unsqueeze(-1), g)  # (C, V)
    grad_z = logits.sub_(lse.unsqueeze(-1)).clamp_(min=EXP_FLOOR)  # log p (at least EXP_FLOOR)
    entropy_term = None
    if g_entropy is not None:
        g_h = g_entropy.to(dtype).unsqueeze(-1) * scale
        entropy_term = (grad_z + entropy[part].unsqueeze(-1)).mul_(grad_z.exp()).mul_(g_h)
    grad_z.exp_().mul_(-g)
    if entropy_term is not None:
        grad_z.sub_(entropy_term)
    return grad_z.scatter_add_(-1, targets.unsqueeze(-1), g)  # (C, V)


def _accumulate(grad_z, part: slice, operands, weight, hidden, grads, scratch) -> None:
    """The chunk's share of the head's gradients from dL/dz (C, V): dL/dh rows (written), dL/dW and dL/db (summed
    over chunks at dL/dz's precision). Under autocast dL/dh runs in its dtype, and dL/dW too on a GPU; on a CPU
    dL/dW is one fp32 addmm_ into the sum: the bf16 product (a (V, H) output from a C-row reduction) writes a
    (V, H) bf16 temporary that the fp32 sum then reads, 2.5x slower at the real vocabulary
    (benchmarks/head_matmul.py), and less exact."""
    h_mm, w_mm = operands
    grad_h, grad_w, grad_b = grads
    low = w_mm is not weight  # autocast: the operands were cast
    if grad_b is not None:
        grad_b += grad_z.sum(0)
    if grad_w is not None and not (low and grad_z.is_cuda):
        grad_w.addmm_(grad_z.T, hidden[part].to(grad_z.dtype))
    grad_mm = grad_z  # dL/dz narrowed to the products' dtype (a bf16 model's, or autocast's) where they need it
    if w_mm.dtype != grad_z.dtype and (grad_h is not None or (low and grad_z.is_cuda)):
        # into the scratch (the products' dtype), or without one into dL/dz's own bytes (spent after this)
        grad_mm = narrow_in_place(grad_z, w_mm.dtype) if scratch is None else \
            scratch[: grad_z.shape[0]].copy_(grad_z)
    if grad_h is not None:
        grad_h[part] = torch.mm(grad_mm, w_mm).to(hidden.dtype)
    if grad_w is not None and low and grad_z.is_cuda:
        grad_w += torch.mm(grad_mm.T, h_mm[part])


class _HeadLogProbs(torch.autograd.Function):
    """Autograd function behind `head_logprobs`; see the module doc for the formulas."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, with_entropy, entropy_grad):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = hidden.new_empty(hidden.shape[0], dtype=dtype)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else None
        rows = max(1, min(rows, hidden.shape[0]))
        h_mm, w_mm, b_mm = _operands(hidden, weight, bias)
        # the products in their own dtype, widened a block at a time: no (C, V) fp32 logits beside a bf16 product
        products = hidden.new_empty((rows, weight.shape[0]), dtype=w_mm.dtype)
        buffers = stats_buffers(rows, weight.shape[0], dtype, hidden.device, narrow=w_mm.dtype != dtype)
        for start in range(0, hidden.shape[0], rows):
            part = slice(start, start + rows)
            product = _product(h_mm[part], w_mm, products)  # (C, V)
            _chunk_stats(product, buffers, targets, part, lse, logp, entropy, b_mm, temperature)
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
            hidden, weight, bias = ctx.saved_tensors[:3]
            operands = _operands(hidden, weight, bias)  # the forward's matmul dtype
        with torch.autocast(device, enabled=False):
            return _HeadLogProbs._backward(ctx, grad_logp, grad_entropy, operands)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy, operands):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        h_mm, w_mm, b_mm = operands
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        dtype = lse.dtype  # fp32 (fp64 for fp64 inputs): gradients of the head accumulate at this precision
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_b else None
        buffer = hidden.new_empty((ctx.rows, weight.shape[0]), dtype=dtype)
        scratch = scratch_buffer(buffer, operands)
        scale = 1.0 / ctx.temperature
        for start in range(0, hidden.shape[0], ctx.rows):
            part = slice(start, start + ctx.rows)
            logits = _chunk_logits(h_mm[part], w_mm, b_mm, ctx.temperature, buffer, scratch)
            g_h = None if grad_entropy is None else grad_entropy[part]
            grad_z = _logit_grads(logits, lse[part], entropy, grad_logp[part], g_h, targets[part], scale, part)
            _accumulate(grad_z, part, (h_mm, w_mm), weight, hidden, (grad_h, grad_w, grad_b), scratch)
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


def grad_sum_in_place(weight: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a gradient of `weight` may be summed straight into weight.grad (created as zeros if None): a weight
    of `dtype` whose gradient, if any, is a plain dense tensor of that dtype and shape, with no tensor or
    post-accumulate hooks (which expect autograd to hand them each backward's gradient)."""
    grad = weight.grad
    return (weight.dtype == dtype and not weight._backward_hooks
            and not getattr(weight, "_post_accumulate_grad_hooks", None)
            and (grad is None or (type(grad) is torch.Tensor and grad.dtype == dtype and grad.shape == weight.shape
                                  and grad.is_contiguous())))


def _weight_grad_sum(weight: torch.Tensor, dtype: torch.dtype, into_grad: bool) -> tuple[torch.Tensor, bool]:
    """The (V, H) sum that dL/dW accumulates in, and whether it is weight.grad itself: with into_grad where
    `grad_sum_in_place` allows (then the backward returns no gradient for the weight: it is there already),
    instead of a second (V, H) buffer that autograd would add into weight.grad; else zeros."""
    if not (into_grad and grad_sum_in_place(weight, dtype)):
        return torch.zeros(weight.shape, dtype=dtype, device=weight.device), False
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad, True


class _HeadTokenLoss(torch.autograd.Function):
    """Autograd function behind `head_token_loss`: the gradients are computed in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, token_loss, with_entropy, into_grad,
                entropy_grad):
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        logp, lse = hidden.new_empty(n, dtype=dtype), hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n, dtype=dtype) if with_entropy else None
        rows = max(1, min(rows, n))
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_w, ctx.into_grad = _weight_grad_sum(weight, dtype, into_grad) if need_w else (None, False)
        grads = (torch.empty_like(hidden) if need_h else None, grad_w,
                 torch.zeros(weight.shape[0], dtype=dtype, device=weight.device) if need_b else None)
        h_mm, w_mm, b_mm = operands = _operands(hidden, weight, bias)
        keep = entropy_grad  # an entropy gradient needs log p: the chunk's logits are kept, not turned into p
        logits_buffer, products, scratch = forward_buffers(hidden, w_mm, rows, dtype, keep)
        buffers = stats_buffers(rows, weight.shape[0], dtype, hidden.device, narrow=w_mm.dtype != dtype)
        loss = torch.zeros((), dtype=dtype, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, n, rows):
                part = slice(start, start + rows)
                product = _product(h_mm[part], w_mm, products)  # (C, V)
                logits = logits_buffer[: product.shape[0]]
                source = logits.copy_(product) if keep and product.dtype != dtype else product
                _chunk_stats(source, buffers, targets, part, lse, logp, entropy, b_mm, temperature,
                             probs=None if keep else logits, keep=keep)
                with torch.enable_grad():  # the loss of these tokens, and its gradient, from their log-probs
                    x = logp[part].detach().requires_grad_()
                    e = entropy[part].detach().requires_grad_(entropy_grad) if with_entropy else None
                    value = token_loss(x, e, part)
                    inputs = (x,) if e is None or not entropy_grad else (x, e)
                    found = torch.autograd.grad(value, inputs, allow_unused=True)
                loss += value.detach()
                g_logp = found[0] if found[0] is not None else torch.zeros_like(x)
                g_entropy = found[1] if len(found) > 1 else None
                grad_z = _logit_grads(logits, lse[part], entropy, g_logp, g_entropy, targets[part],
                                      1.0 / temperature, part, probs=not keep)
                _accumulate(grad_z, part, operands[:2], weight, hidden, grads, scratch)
        grad_h, grad_w, grad_b = grads
        grad_w = None if grad_w is None or ctx.into_grad else grad_w.to(weight.dtype)  # in weight.grad already
        ctx.save_for_backward(grad_h, grad_w, None if grad_b is None else grad_b.to(bias.dtype))
        # one call: a second mark_non_differentiable replaces the first (the log-probs would stay differentiable)
        ctx.mark_non_differentiable(*(t for t in (logp, entropy) if t is not None))
        ctx.set_materialize_grads(False)
        ctx.spent = False
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, grad_logp, grad_entropy):
        if grad_loss is None:
            return (None,) * 10
        if ctx.spent:
            raise RuntimeError("head_token_loss's backward ran twice (retain_graph): its gradients were computed "
                               "in the forward and are handed over once; run the forward again instead.")
        ctx.spent = True
        grad_h, grad_w, grad_b = ctx.saved_tensors
        if ctx.into_grad:  # dL/dW is in weight.grad beside the earlier micro-batches': it cannot be scaled now
            _assert_unit(grad_loss)
        elif grad_loss.device.type == "cpu" and bool(grad_loss == 1):  # free to read on a CPU: no (V, H) pass
            pass
        else:  # on a device, no host sync to find out: scale in place (the tensors are this backward's own)
            for grad in (grad_h, grad_w, grad_b):
                if grad is not None:
                    grad.mul_(grad_loss.to(grad.dtype))
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


UNIT_MESSAGE = ("head_token_loss(into_grad=True) summed dL/dW into the weight's gradient, which needs the loss to be "
                "backpropagated with upstream gradient 1{found}: backpropagate the loss itself (weight the token "
                "losses instead), or pass into_grad=False")


def _assert_unit(grad_loss: torch.Tensor) -> None:
    """into_grad's contract, checked without a host sync: read on a CPU, asserted on the device elsewhere."""
    if grad_loss.device.type != "cpu":
        torch._assert_async(grad_loss == 1, UNIT_MESSAGE.format(found=""))
    elif not bool(grad_loss == 1):
        raise RuntimeError(UNIT_MESSAGE.format(found=f", not {grad_loss.item()}"))


def head_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    token_loss,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    into_grad: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A loss that is a sum over tokens of functions of each token's log-prob (and entropy), with the head's
    gradients computed in the forward pass: 3 head matmuls per token (logits, dL/dh, dL/dW) where
    `head_logprobs` followed by the loss's backward takes 4 (its backward recomputes the logits).

    token_loss(logp (C,), entropy (C,) or None, part: slice) -> () is called once per chunk of positions
    `part` of the flattened (N,) tokens, with log-probs (and entropies) that require grad; it must depend on
    those tokens' values only (the caller's `losses.token_separable`). Shapes as in `head_logprobs`.
    entropy_grad: the entropies given to token_loss require grad (an entropy bonus). False: they are constants,
    and each chunk's softmax replaces its logits while the log-sum-exp is computed, so that dL/dz = g (onehot(y)
    - p) / tau is one pass over the chunk instead of four (log p, its clamp, exp, the product).

    into_grad: dL/dW is summed straight into weight.grad (zeros first if it is None) rather than into a second
    (V, H) buffer (155 MB at a vocabulary of 151,936 and H = 256, fp32) that autograd would add into weight.grad
    in the backward, which then returns no gradient for the weight. The caller must backpropagate the loss with
    upstream gradient exactly 1 (anything else raises in the backward: dL/dW cannot be told apart from the
    earlier micro-batches' gradient by then) and must not read the weight's gradient in between. Only where
    `grad_sum_in_place` allows (a plain dense gradient of the weight's dtype, no hooks on the weight);
    the learner turns it on where no DDP, FSDP or gradient scaler watches the gradients.

    Returns:
        () the summed loss (differentiable w.r.t. hidden, weight, bias), (N,) log-probs and (N,) entropies or
        None, both detached (float32, float64 for float64 inputs).
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    rows = chunk_rows(weight.shape[0], chunk_elements)
    return _HeadTokenLoss.apply(flat_hidden, weight, bias, flat_targets, float(temperature), rows, token_loss,
                                with_entropy, into_grad, entropy_grad)

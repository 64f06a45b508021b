"""The fused head's buffer plans: which (C, V) buffers a chunked head pass allocates, and which of them share bytes.

`fused_head` keeps the autograd Functions and their formulas; this module decides where each chunk's products,
logits, softmax and dL/dz live. A fresh (C, V) tensor per chunk costs as much in page faults as the matmul itself
on a CPU, so every plan allocates its buffers once per pass and reuses them across chunks.

Two plans alias bytes, and only on a CPU (each asserts it): a bf16 product written into the upper half of the fp32
buffer its softmax then overwrites (`upper_half`), and dL/dz narrowed to bf16 into its own bytes row by row
(`narrow_in_place`: on a GPU that row loop would be C kernel launches; a scratch buffer is used there instead).
"""

from __future__ import annotations

import torch

STATS_ELEMENTS = 1 << 21  # exp(z - max) entries that exist at once: a cache-sized buffer, not a second (C, V)


def scratch(logits_buffer: torch.Tensor, operands) -> torch.Tensor | None:
    """A (C, V) buffer in the matmul operands' dtype when it differs from the logits' (autocast): each chunk's
    product lands there before it is widened into the logits, and dL/dz is narrowed there for dL/dh, instead of
    two fresh (C, V) tensors per chunk."""
    weight = operands[1]
    return None if weight.dtype == logits_buffer.dtype else logits_buffer.new_empty(logits_buffer.shape,
                                                                                    dtype=weight.dtype)


def upper_half(buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (C, V) view in `dtype` (half the element size of the (C, V) buffer's) of the second half of the
    buffer's bytes. A chunk's narrow product lands there and `_chunk_stats` writes the softmax into the buffer's
    rows in order: row r's values overwrite product rows below 2r + 2 - C, all read by then. CPU only."""
    assert buffer.device.type == "cpu", "aliasing buffer plans are for the CPU"
    rows, vocab = buffer.shape
    return buffer.view(-1).view(dtype)[rows * vocab :].view(rows, vocab)


def narrow_in_place(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values (c, V), contiguous, cast to `dtype` (half the element size) into the first half of their own bytes,
    row by row: row r's copy lands inside row r // 2, which is read by then (row 0's copy waits in a one-row
    temporary). (c, V) in `dtype`; values is spent. One buffer where a copy would need a second (C, V) one. CPU
    only."""
    assert values.device.type == "cpu", "aliasing buffer plans are for the CPU"
    rows, vocab = values.shape
    narrow = values.view(-1).view(dtype)[: rows * vocab].view(rows, vocab)
    first = values[0].to(dtype)
    for row in range(1, rows):
        narrow[row].copy_(values[row])
    narrow[0].copy_(first)
    return narrow


def stats_buffers(rows: int, vocab: int, dtype: torch.dtype, device, narrow: bool):
    """The buffers `_chunk_stats` needs beside (C, V) products: exp(z - max) of a block of min(C, max(1,
    STATS_ELEMENTS // V)) rows (13 at a vocabulary of 151,936; a small vocabulary's whole chunk), and for a narrow
    product (bf16) the block's logits widened to `dtype`, else None."""
    block = (min(rows, max(1, STATS_ELEMENTS // vocab)), vocab)
    exps = torch.empty(block, dtype=dtype, device=device)
    return exps, (torch.empty(block, dtype=dtype, device=device) if narrow else None)


def forward_buffers(hidden, w_mm, rows: int, dtype, keep: bool):
    """The loss-in-the-forward's (C, V) buffers: logits (`dtype`: they become p, then dL/dz), where each chunk's
    product lands, and the scratch that dL/dz is narrowed into for dL/dh (None: none needed, or in place).
    Products in `dtype` land in the logits. Narrow products (bf16) on a CPU with the softmax written over them
    (not keep) land in the logits buffer's upper half (`upper_half`) and dL/dz is narrowed in place: one (C, V)
    fp32 buffer in all. Elsewhere (on a GPU, where the in-place narrowing's row loop would be C kernel launches;
    or the entropy-gradient path, which keeps each chunk's logits) a (C, V) scratch in the products' dtype."""
    logits = hidden.new_empty((rows, w_mm.shape[0]), dtype=dtype)
    if w_mm.dtype == dtype:
        return logits, logits, None
    if hidden.device.type == "cpu" and not keep:
        return logits, upper_half(logits, w_mm.dtype), None
    buffer = scratch(logits, (hidden, w_mm))
    return logits, buffer, buffer

"""Handing the C allocator's free memory back to the operating system between a step's phases.

PyTorch's CPU tensors come from the C library's malloc. glibc serves blocks below its mmap threshold (which grows
with use, up to 32 MiB) from heaps it trims only at their top, so after a phase frees its activations (a training
forward's are hundreds of MiB at a real vocabulary) most of those pages stay resident, and the next phase's large
tensors, mapped fresh, land on top of them. `release_free_memory` asks glibc to return every free page
(`malloc_trim(0)`) at the end of the reference pass and of each optimizer step, and `trim_before_embedding_backward`
once more inside each backward, just before the input embedding's: by then the layers' activations are freed, and
the embedding's dense (V, H) gradient, mapped fresh, is the backward's largest allocation. A call takes a few
milliseconds (docs/performance.md has what it saves on the `real` benchmark). Only heaps holding at least TRIM_AT
(256 MiB) free are trimmed: the pages a small model's step frees are cheaper to keep than to fault in again. Where
the C library has no malloc_trim and mallinfo2 (musl, macOS, glibc before 2.33) they do nothing.

`embedding_rows_into_grad` spares the backward's largest allocation where it can: the embedding's gradient rows
go straight into weight.grad instead of a dense (V, H) gradient (the trim before it still returns the freed
activations).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import weakref
from typing import Any

import torch

from grpokit.algorithms.fused_head import grad_sum_in_place


TRIM_AT = 256 << 20  # free bytes in the allocator's heaps worth returning: below, re-faulting them costs more


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    try:
        libc = ctypes.CDLL(None)  # the C library this process already uses
        trim, info = libc.malloc_trim, libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    info.argtypes, info.restype = [], _MallInfo2
    return trim, info


def release_free_memory(at_least: int = TRIM_AT) -> bool:
    """Return the allocator's free pages to the operating system when its heaps hold at least `at_least` free
    bytes (fewer: the pages are left for the next allocations, which would otherwise fault them in again; on the
    small benchmark an unconditional trim cost 8% of a 0.7 s step). True when it trimmed."""
    calls = _malloc_trim()
    if calls is None:
        return False
    trim, info = calls
    if info().fordblks < at_least:
        return False
    trim(0)
    return True


# The trimming hook on each embedding: one model object given to a second trainer replaces its hook, never adds one.
_TRIM_HOOKS: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()


def trim_before_embedding_backward(model: torch.nn.Module, device: torch.device) -> None:
    """Trim in every backward pass just before the gradient of the model's input embedding is computed (a hook on
    the embedding's output), when that dense gradient is large (at least TRIM_AT / 4: 64 MiB) and the heaps hold
    at least as many free bytes; nothing for a model without an input embedding, or one trained on another
    `device` than the CPU (its tensors are not the C allocator's)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if weight is None or _malloc_trim() is None or device.type != "cpu":
        return
    size = weight.numel() * weight.element_size()
    if size < TRIM_AT // 4:
        return

    def release(grad: torch.Tensor) -> None:
        release_free_memory(at_least=size)

    def on_output(module, inputs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(release)

    earlier = _TRIM_HOOKS.pop(embedding, None)
    if earlier is not None:
        earlier.remove()
    _TRIM_HOOKS[embedding] = embedding.register_forward_hook(on_output)


class _RowsIntoGrad(torch.autograd.Function):
    """F.embedding whose backward adds the looked-up rows' gradients into weight.grad in place (zeros first if
    None) and hands autograd no gradient for the weight: dL/dE[i] = sum of dL/dout over the positions with id i,
    padding_idx's row excepted, as F.embedding's backward."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):
        ctx.save_for_backward(ids, weight)
        ctx.padding_idx = padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        ids, weight = ctx.saved_tensors
        ids, rows = ids.reshape(-1), grad_out.reshape(-1, weight.shape[1])  # (n,), (n, H)
        if ctx.padding_idx is not None:
            keep = ids != ctx.padding_idx
            ids, rows = ids[keep], rows[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, ids, rows.to(weight.grad.dtype))
        return None, None, None


@contextlib.contextmanager
def embedding_rows_into_grad(model: torch.nn.Module):
    """Within it, the forwards of `model`'s input embedding (a plain nn.Embedding, fp32, no max_norm or
    scale_grad_by_freq) sum their gradient's rows straight into the embedding weight's gradient in the backward
    (`_RowsIntoGrad`), instead of forming a dense (V, H) gradient that is zeros but for the rows looked up and
    that autograd then adds into weight.grad: at the real vocabulary each backward spares 155 MB and ~115 ms
    (the zeroing, the scatter, the addition). For a tied head the head's gradient (`head_token_loss`' into_grad)
    and the rows meet in the same weight.grad. Nothing changes where the weight has hooks or a gradient of
    another form (`grad_sum_in_place`). The caller makes sure nothing but autograd handles the gradients (no DDP,
    no FSDP, a CPU: `grpokit.train.in_place`)."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    plain = (type(embedding) is torch.nn.Embedding and "forward" not in vars(embedding) and weight.requires_grad
             and embedding.max_norm is None and not embedding.scale_grad_by_freq and not embedding.sparse
             and grad_sum_in_place(weight, torch.float32))
    if not plain:
        yield
        return
    embedding.forward = lambda ids: _RowsIntoGrad.apply(ids, embedding.weight, embedding.padding_idx)
    try:
        yield
    finally:
        del embedding.forward

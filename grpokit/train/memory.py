"""Handing the C allocator's free memory back to the operating system between a step's phases.

PyTorch's CPU tensors come from the C library's malloc. glibc serves blocks below its mmap threshold (which grows
with use, up to 32 MiB) from heaps it trims only at their top, so after a phase frees its activations (a training
forward's are hundreds of MiB at a real vocabulary) most of those pages stay resident, and the next phase's large
tensors, mapped fresh, land on top of them. `release_free_memory` asks glibc to return every free page
(`malloc_trim(0)`) at the end of the reference pass and of each optimizer step, and `trim_before_embedding_backward`
once more inside each backward, just before the input embedding's: by then the layers' activations are freed, and
the embedding's dense (V, H) gradient, mapped fresh, is the backward's largest allocation. A call takes a few
milliseconds (docs/performance.md has what it saves on the `real` benchmark). Only heaps holding at least TRIM_AT
(256 MiB) free are trimmed: the pages a small model's step frees are cheaper to keep than to fault in again. Where the C library has no malloc_trim and mallinfo2
(musl, macOS, glibc before 2.33) they do nothing.
"""

from __future__ import annotations

import ctypes
import functools

import torch


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


def trim_before_embedding_backward(model: torch.nn.Module) -> None:
    """Trim in every backward pass just before the gradient of the model's input embedding is computed (a hook on
    the embedding's output), when that dense gradient is large (at least TRIM_AT / 4: 64 MiB) and the heaps hold
    at least as many free bytes; nothing for a model without an input embedding."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embedding, "weight", None)
    if weight is None or _malloc_trim() is None:
        return
    size = weight.numel() * weight.element_size()
    if size < TRIM_AT // 4:
        return

    def release(grad: torch.Tensor) -> None:
        release_free_memory(at_least=size)

    def on_output(module, inputs, output):
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(release)

    embedding.register_forward_hook(on_output)

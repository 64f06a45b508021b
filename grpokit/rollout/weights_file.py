"""A stream of weights written into one safetensors file, a tensor at a time (the vLLM server's push, an export).

The stream is any object with `specs()` -> [(name, shape, dtype)] and iteration over (name, tensor) pairs in the
same order (grpokit.train.weights.WeightStream). The header is written first from the specs, then each tensor is
appended as it arrives, so the whole model is never in memory; the file appears whole or not at all.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


class WeightsFileError(OSError):
    """The weights file could not be written (the path and the OS error are in the message)."""


def header(specs) -> bytes:
    """safetensors' header for tensors laid end to end in the specs' order: 8-byte length, then JSON padded so
    the data starts 8-byte aligned, as safetensors writes it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in specs:
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(stream, path: Path, keep: bool = True) -> None:
    """`path` with every tensor of `stream`, written by a caller with `keep` (the others only read the stream to
    its end: under FSDP reading it is a collective). A write error is raised after the stream's end, so other
    processes are never left waiting in a gather."""
    handle, error, partial = None, None, path.with_name(path.name + ".partial")
    if keep:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(partial, "wb")
            handle.write(header(stream.specs()))
        except OSError as exc:
            error = exc
    try:
        for _, tensor in stream:
            if handle is not None and error is None:
                try:
                    handle.write(tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                except OSError as exc:
                    error = exc
    finally:
        if handle is not None:
            handle.close()
    if error is not None:
        raise WeightsFileError(f"Could not write the weights into {path}: {error}") from error
    if keep:
        os.replace(partial, path)

"""A stream of weights written into one safetensors file, a tensor at a time (the vLLM server's push, an export),
and a Hugging Face model folder around it (`write_model_folder`: vLLM's starting folder, Learner.export).

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
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64",
}


class WeightsFileError(OSError):
    """The weights file could not be written (the path and the OS error are in the message)."""


def header(specs) -> bytes:
    """safetensors' header for tensors laid end to end in the specs' order: 8-byte length, then JSON padded so
    the data starts 8-byte aligned, as safetensors writes it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in specs:
        if dtype not in SAFETENSORS_DTYPES:
            raise KeyError(f"{name} is {dtype}, which safetensors does not store")
        size = int(torch.Size(shape).numel()) * dtype.itemsize
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def write_safetensors(stream, path: Path, keep: bool = True) -> None:
    """`path` with every tensor of `stream`, written by a caller with `keep` (the others only read the stream to
    its end: under FSDP reading it is a collective). Every tensor must be the one its spec announced (name, shape,
    dtype, in order), else the file would not read back. Any error is raised after the stream's end, so other
    processes are never left waiting in a gather, and leaves no partial file."""
    specs = list(stream.specs())
    handle, error, partial = None, None, path.with_name(path.name + ".partial")
    if keep:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(partial, "wb")
            handle.write(header(specs))
        except (OSError, KeyError) as exc:
            error = exc
    try:
        written = 0
        for index, (name, tensor) in enumerate(stream):
            if handle is not None and error is None:
                error = _append(handle, specs, index, name, tensor)
            written = index + 1
        if error is None and written != len(specs):
            error = ValueError(f"the stream gave {written} tensors where its specs announced {len(specs)}")
    except BaseException:  # the stream itself failed: no partial file left behind
        if handle is not None:
            handle.close()
            partial.unlink(missing_ok=True)
        raise
    if handle is not None:
        handle.close()
    if error is not None:
        partial.unlink(missing_ok=True)
        raise WeightsFileError(f"Could not write the weights into {path}: {error}") from error
    if keep:
        os.replace(partial, path)


def _append(handle, specs, index: int, name: str, tensor: torch.Tensor) -> Exception | None:
    """Write one tensor's bytes after checking it against its spec; the error instead of raising."""
    if index >= len(specs) or specs[index][0] != name or tuple(specs[index][1]) != tuple(tensor.shape) \
            or specs[index][2] != tensor.dtype:
        expected = specs[index] if index < len(specs) else "nothing"
        return ValueError(f"tensor {index} is {name} {tuple(tensor.shape)} {tensor.dtype}, its spec {expected}")
    try:
        handle.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    except OSError as exc:
        return exc
    return None


def write_model_folder(stream, config, generation_config, folder: Path, keep: bool = True) -> None:
    """A Hugging Face model folder: config.json, generation_config.json (when given) and model.safetensors written
    from the stream, whole or not at all, by the processes with `keep` (the others, under FSDP, only take part in
    the gathers)."""
    if keep:
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        if generation_config is not None:
            generation_config.save_pretrained(folder)
    write_safetensors(stream, folder / "model.safetensors", keep)

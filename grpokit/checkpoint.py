"""Atomic checkpoints: everything a run needs to continue exactly, written so a kill never corrupts the newest one.

Layout of `output_dir/checkpoint-<step>/`: the model (HF format) and tokenizer, `optimizer.pt`, `scheduler.pt`,
`trainer_state.json` (step counters, data position), `rng_state_<rank>.pt` (python, numpy, torch) and, when the
step falls inside a reused generation batch, `experience_<rank>.pt` (the buffered batch, so resume is exact).
The folder is written under a temporary name and renamed into place only when complete; a folder without the
`trainer_state.json` written last, or with a temporary name, is never picked for resume. `trainer_state.json`
lists every other file of the folder with its size and SHA-256 (`manifest`), and `verify` checks them before a
resume reads anything, so a damaged file is named instead of failing deep inside torch or safetensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"


def checkpoint_dirs(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = CHECKPOINT_PATTERN.match(child.name)
        if match and child.is_dir() and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def newest_checkpoint(output_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(output_dir)
    return dirs[-1] if dirs else None


def staging_dir(output_dir: str | Path, step: int) -> Path:
    """Where checkpoint-<step> is assembled before the rename (same filesystem, so the rename is atomic)."""
    return Path(output_dir) / f".checkpoint-{step}.tmp"


def publish(staging: Path, output_dir: str | Path, step: int, save_total_limit: int | None) -> Path:
    """Rename a finished staging folder into place, then delete checkpoints beyond the limit."""
    final = Path(output_dir) / f"checkpoint-{step}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(Path(output_dir))
    if save_total_limit is not None:
        for old in checkpoint_dirs(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def remove_stale_staging(output_dir: str | Path) -> None:
    """Delete half-written checkpoints left by a run that was killed while saving."""
    root = Path(output_dir)
    if root.is_dir():
        for child in root.glob(".checkpoint-*.tmp"):
            shutil.rmtree(child, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from; the message names the damaged file and what to do."""


def read_state(checkpoint: Path) -> dict[str, Any]:
    path = checkpoint / STATE_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}.") from exc


def file_digest(path: Path) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex digest} of one file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file of a checkpoint folder but the state file, relative path -> file_digest."""
    return {str(p.relative_to(folder)): file_digest(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != STATE_FILE}


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint (its state file unreadable, a listed file missing, resized or changed),
    or None when every file matches the manifest written at save time. Checkpoints written before manifests
    existed are only checked for a readable state file."""
    try:
        listed = read_state(checkpoint).get("manifest", {})
    except CheckpointError as exc:
        return str(exc)
    for name, expected in listed.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != expected["size"]:
            return f"{path} has {size} bytes, {expected['size']} were saved"
        if file_digest(path)["sha256"] != expected["sha256"]:
            return f"{path} changed since it was saved (its SHA-256 differs)"
    return None


def newest_verified(output_dir: str | Path, before: Path | None = None) -> Path | None:
    """The newest complete checkpoint that verifies (older than `before` when given)."""
    dirs = checkpoint_dirs(output_dir)
    if before is not None:
        dirs = [d for d in dirs if _step(d) < _step(before)]
    return next((d for d in reversed(dirs) if damage(d) is None), None)


def _step(checkpoint: Path) -> int:
    match = CHECKPOINT_PATTERN.match(checkpoint.name)
    return int(match.group(1)) if match else -1


def free_space(path: Path) -> str:
    """The free space of the filesystem holding `path` (or its nearest existing parent), e.g. '1.2 GiB'."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB"
    except OSError:
        return "unknown"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

"""Atomic checkpoints: everything a run needs to continue exactly, written so a kill never corrupts the newest one.

Layout of `output_dir/checkpoint-<step>/`: the model (HF format) and tokenizer, `optimizer.pt`, `scheduler.pt`,
`trainer_state.json` (step counters, data position), `rng_state_<rank>.pt` (python, numpy, torch) and, when the
step falls inside a reused generation batch, `experience_<rank>.pt` (the buffered batch, so resume is exact).
The folder is written under a temporary name and renamed into place only when complete; a folder without the
`trainer_state.json` written last, or with a temporary name, is never picked for resume.
"""

from __future__ import annotations

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


def read_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE_FILE).read_text())


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

"""Atomic writes of a run's files and folders: a folder assembled under a staging name and swapped in whole
(`fresh_folder`, `swap_in`), files renamed into a folder one at a time (`replace_files`), JSON written to a
temporary file, synced and renamed (`write_json`). A kill or a failed write (a full disk) never leaves half a file
or half a folder under a name that counts. Used by grpokit.train.checkpointer (checkpoints, the final and best
model) and grpokit.train.hub."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any


def fresh_folder(folder: Path) -> None:
    """An empty `folder` (what an earlier attempt left in it is removed). Its parent must exist: an output_dir
    removed under a run is not silently created again (the save fails with a SaveError instead)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()


def swap_in(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`; a folder already at `final` is first renamed aside (to a name that the
    checkpointer's remove_stale_staging deletes) and deleted afterwards, so that a kill leaves no half-deleted
    folder under a name that counts."""
    aside = final.with_name(f".{final.name}.old.tmp")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(staging, final)
    _fsync_dir(final.parent)
    shutil.rmtree(aside, ignore_errors=True)


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


def replace_files(folder: Path, staging: Path, write: Callable[[Path], None]) -> None:
    """write(staging), then each file it wrote renamed into `folder` (created if missing); files of `folder` it
    did not write are left. A folder in the way of one of them fails the save before any file is replaced."""
    shutil.rmtree(staging, ignore_errors=True)
    write(staging)
    folder.mkdir(parents=True, exist_ok=True)
    moves = [(path, folder / path.name) for path in staging.iterdir()]
    blocked = next((target for _, target in moves if target.is_dir()), None)
    if blocked is not None:
        raise IsADirectoryError(errno.EISDIR, "a folder is where a file of the model goes", str(blocked))
    for path, target in moves:
        os.replace(path, target)

"""Checkpoints and model exports: everything a run needs to continue exactly, written so a kill never corrupts
the newest one.

    checkpointer.save(step, parts)            # parts: {name: Stateful}, each writes its files and its JSON
    checkpointer.load(checkpoint, parts)      # after resume_path() chose and verified the folder
    checkpointer.save_model(folder, learner)  # the final model; track_best() the best one (OUTPUT_DIR/best)

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
import logging
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

logger = logging.getLogger("grpokit")

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


class SaveError(OSError):
    """A model or checkpoint could not be written; the message names the path and the free space there."""


class Stateful(Protocol):
    """A part of a run's state: `save` writes this process's files into the staging folder and returns what goes
    into trainer_state.json under the part's name (process 0's; None: nothing); `load` reads them back."""

    def save(self, folder: Path) -> Any: ...

    def load(self, folder: Path, saved: Any) -> None: ...


class RandomState:
    """Every RNG of this process (python, numpy, torch, CUDA): rng_state_<rank>.pt."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save(self, folder: Path) -> None:
        torch.save(rng_state(), folder / f"rng_state_{self.rank}.pt")

    def load(self, folder: Path, saved: Any) -> None:
        set_rng_state(torch.load(folder / f"rng_state_{self.rank}.pt", weights_only=False))


class Checkpointer:
    """checkpoint-<step> folders under output_dir (atomic, verified, rotated), the resume choice, and the final and
    best model exports. `comm`: the run's processes (process 0 publishes; every process writes its own files)."""

    def __init__(self, args, comm) -> None:
        self.args, self.comm = args, comm

    def save(self, step: int, parts: dict[str, Stateful]) -> Path:
        comm, out = self.comm, self.args.output_dir
        staging = staging_dir(out, step)
        if comm.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        comm.barrier()
        try:
            saved = {name: part.save(staging) for name, part in parts.items()}
            comm.barrier()
        except OSError as exc:
            shutil.rmtree(staging, ignore_errors=True)
            raise SaveError(f"Saving checkpoint-{step} to {staging} failed: {exc} ({free_space(staging)} free "
                            "there). Earlier checkpoints are unchanged; free some space and resume.") from exc
        final = Path(out) / f"checkpoint-{step}"
        if comm.is_main:
            state = {name: value for name, value in saved.items() if value is not None}
            state["num_processes"] = comm.size
            state["manifest"] = manifest(staging)  # size and SHA-256 of every file, checked before a resume
            write_json(staging / STATE_FILE, state)  # written last: marks the folder complete
            final = publish(staging, out, step, self.args.save_total_limit)
        comm.barrier()
        return final

    def load(self, checkpoint: Path, parts: dict[str, Stateful]) -> None:
        saved = read_state(checkpoint)
        if saved["num_processes"] != self.comm.size:
            from grpokit.config import ConfigError

            raise ConfigError(
                f"{checkpoint} was written by {saved['num_processes']} processes; resume it with the same number."
            )
        for name, part in parts.items():
            part.load(checkpoint, saved.get(name))
        if self.comm.is_main:
            from grpokit.metrics import trim_jsonl

            for name in ("metrics.jsonl", "completions.jsonl"):
                trim_jsonl(Path(self.args.output_dir) / name, saved["trainer"]["global_step"])
        logger.info("Resumed from %s at step %d.", checkpoint, saved["trainer"]["global_step"])

    def resume_path(self, resume: bool | str | None) -> Path | None:
        """The checkpoint to resume from (None: a new run, whose old metrics files are removed), verified."""
        from grpokit.config import ConfigError

        out = self.args.output_dir
        if self.comm.is_main:
            remove_stale_staging(out)
        self.comm.barrier()
        if resume is None or resume is False:
            if checkpoint_dirs(out) and not self.args.overwrite_output_dir:
                raise ConfigError(
                    f"{out} already holds checkpoints; resume with train(resume_from_checkpoint=True) / --resume, "
                    "set overwrite_output_dir=True, or choose another output_dir."
                )
            if self.comm.is_main:
                for name in ("metrics.jsonl", "completions.jsonl"):
                    (Path(out) / name).unlink(missing_ok=True)
            return None
        checkpoint = newest_checkpoint(out) if resume is True else Path(resume)
        if checkpoint is None:
            raise ConfigError(f"resume_from_checkpoint=True but {out} holds no complete checkpoint-<step> folder.")
        if not (checkpoint / STATE_FILE).is_file():
            raise ConfigError(f"{checkpoint} is not a complete checkpoint (no {STATE_FILE}).")
        return self.verified(checkpoint, picked_newest=resume is True)

    def verified(self, checkpoint: Path, picked_newest: bool) -> Path:
        """`checkpoint` when every file matches its manifest; else, with resume_fallback and a checkpoint picked
        as the newest, the newest older one that verifies; else a CheckpointError naming the damage."""
        problem = damage(checkpoint)
        if problem is None:
            return checkpoint
        older = newest_verified(self.args.output_dir, before=checkpoint)
        if older is not None and picked_newest and self.args.resume_fallback:
            logger.warning("Skipping %s: %s. Resuming from %s, the newest older checkpoint that verifies.",
                           checkpoint, problem, older)
            return older
        advice = (f"The newest older checkpoint that verifies is {older}: resume from it with "
                  f"resume_from_checkpoint='{older}', or set resume_fallback=True (--resume_fallback true) so that "
                  "--resume picks it." if older is not None else
                  "No older checkpoint verifies; start again with overwrite_output_dir=True or another output_dir.")
        raise CheckpointError(f"Cannot resume from {checkpoint}: {problem}. {advice}")

    def save_model(self, folder: str | Path, write) -> None:
        """The model and tokenizer into `folder` (write(staging) writes them), atomically: written to a staging
        folder beside it, then each file renamed into place, so a failed save (a full disk) leaves the previous
        files as they were."""
        comm, folder = self.comm, Path(folder)
        comm.barrier()
        if comm.is_main:
            staging = folder.parent / f".{folder.name}.model-staging"
            try:
                shutil.rmtree(staging, ignore_errors=True)
                write(staging)
                folder.mkdir(parents=True, exist_ok=True)
                for path in staging.iterdir():
                    os.replace(path, folder / path.name)
            except OSError as exc:
                raise SaveError(f"Saving the model to {folder} failed: {exc} ({free_space(folder)} free there). The "
                                "files already in that folder are unchanged; free some space and call save_model "
                                "again, or resume from the newest checkpoint.") from exc
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        comm.barrier()

    def track_best(self, result: dict[str, float], state, write) -> None:
        """Save the model to OUTPUT_DIR/best (write(folder) writes it) when the evaluation improved
        metric_for_best_model; state.best_metric / best_model_checkpoint record it."""
        from grpokit.config import ConfigError
        from grpokit.train.telemetry import eval_key

        args, comm = self.args, self.comm
        name = args.metric_for_best_model or ("eval/reward" if args.load_best_model_at_end else None)
        if name is None:
            return
        key = eval_key(name)
        if key not in result:
            raise ConfigError(f"metric_for_best_model={name!r} is not an eval metric; this run logs: "
                              f"{', '.join(k for k in result if k != 'step')}.")
        value, best = result[key], state.best_metric
        larger = args.greater_is_better is not False
        if math.isnan(value) or (best is not None and (value <= best if larger else value >= best)):
            return
        state.best_metric = value
        folder = Path(args.output_dir) / "best"
        staging = Path(args.output_dir) / ".best-staging"
        if comm.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            write(staging)
        comm.barrier()
        if comm.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            staging.rename(folder)
            write_json(folder / "best.json", {"step": state.global_step, key: value})
        comm.barrier()
        state.best_model_checkpoint = str(folder)

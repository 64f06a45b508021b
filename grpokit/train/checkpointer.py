"""Checkpoints and model exports: everything a run needs to continue exactly, written so a kill never corrupts
the newest one, and a failed write (a full disk) never leaves half a file in place of a good one.

    with checkpointer.holding_output_dir():   # train(): one run per output_dir (OutputLock)
        checkpointer.save(step, parts)        # parts: {name: Stateful}, each writes its files and its JSON
        checkpointer.load(checkpoint, parts)  # after resume_path() chose and verified the folder
    checkpointer.save_model(folder, write)    # the final model; track_best() the best one (OUTPUT_DIR/best)

Layout of `output_dir/checkpoint-<step>/`: the model (HF format) and tokenizer, `optimizer.pt`, `scheduler.pt`,
`trainer_state.json` (step counters, data position), `rng_state_<rank>.pt` (python, numpy, torch) and, when the
step falls inside a reused generation batch, `experience_<rank>.pt` (the buffered batch, so resume is exact).
Under FSDP2 the weights, optimizer state and synced reference are instead in `sharded/` (torch.distributed.checkpoint:
every process writes its own shards; grpokit/train/distcp.py), beside config.json, the tokenizer and scheduler.pt;
`grpo export` makes a Hugging Face folder of it. A checkpoint resumes at another number of processes: the weights
and optimizer state are re-sharded (or read whole), the per-process parts (RNG, the partly used batch) are not read.
`manifest.json`, written last, lists every other file of the folder, trainer_state.json included, with its size
and SHA-256, and holds the SHA-256 of that list, so that a damaged manifest is named as such instead of blaming
the file whose entry changed. The folder is written under a temporary name and renamed into place only when
complete; a folder with a temporary name is never picked for resume. `damage` checks a checkpoint against its
manifest before a resume reads anything, so a damaged file is named instead of failing deep inside torch or
safetensors, or, for a flipped digit in trainer_state.json, resuming silently at the wrong place. Checkpoints
written before manifest.json existed keep their manifest inside trainer_state.json (which it does not cover)
and are checked against it as before.

Every write goes through `Checkpointer._together`: a failure on any process (OSError, torch's RuntimeError,
safetensors' SafetensorError) becomes the same SaveError on every process, naming the path and the free space,
after the staging folder is removed; the previous checkpoint or model is left as it was. The atomic writes
(folders swapped in, files renamed into place, synced JSON) are in atomic.py, the output_dir lock in output_lock.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from grpokit.rng import rng_state, set_rng_state
from grpokit.errors import CheckpointError, ConfigError, SaveError, is_write_error, save_error
from grpokit.train.atomic import fresh_folder, replace_files, swap_in, write_json  # importable from here too
from grpokit.train.output_lock import LOCK_FILE, OutputLock  # noqa: F401 - importable from here too

logger = logging.getLogger("grpokit")

CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"


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
    """Rename a finished staging folder into place, then delete checkpoints beyond the limit (each renamed aside
    first, as swap_in does)."""
    final = Path(output_dir) / f"checkpoint-{step}"
    swap_in(staging, final)
    if save_total_limit is not None:
        for old in checkpoint_dirs(output_dir)[:-save_total_limit]:
            aside = old.with_name(f".{old.name}.old.tmp")
            os.replace(old, aside)
            shutil.rmtree(aside, ignore_errors=True)
    return final


def remove_stale_staging(output_dir: str | Path) -> None:
    """Delete half-written checkpoints (and old ones half-deleted) left by a run that was killed while saving."""
    root = Path(output_dir)
    if root.is_dir():
        for child in root.glob(".checkpoint-*.tmp"):
            shutil.rmtree(child, ignore_errors=True)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} cannot be read: {type(exc).__name__}: {exc}.") from exc


def read_state(checkpoint: Path) -> dict[str, Any]:
    state = read_json(checkpoint / STATE_FILE)
    if not isinstance(state, dict):
        raise CheckpointError(f"{checkpoint / STATE_FILE} is damaged: not a JSON object.")
    return state


def file_digest(path: Path) -> dict[str, Any]:
    """{"size": bytes, "sha256": hex digest} of one file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def folder_files(folder: Path) -> list[str]:
    """Every file of a checkpoint folder but its manifest, as paths relative to the folder."""
    return [str(p.relative_to(folder)) for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE]


def digest_share(folder: Path, rank: int, size: int) -> dict[str, Any]:
    """The digests of this process's share of a folder's files (every size-th, from the rank-th), so that the
    processes of a run hash a sharded checkpoint's files in parallel instead of process 0 reading them all."""
    return {file: file_digest(folder / file) for file in folder_files(folder)[rank::size]}


def list_digest(checkpoint: str, files: dict[str, Any]) -> str:
    """The SHA-256 of a manifest's checkpoint name and file list (canonical JSON): the manifest's own checksum."""
    listing = json.dumps({"checkpoint": checkpoint, "files": files}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(listing.encode()).hexdigest()


def write_manifest(folder: Path, name: str, known: dict[str, Any] | None = None) -> None:
    """manifest.json of the checkpoint `name` assembled in `folder`: the size and SHA-256 of every other file, the
    checkpoint's name (a manifest copied from another checkpoint is named as such), and their checksum. `known`:
    digests already taken (by other processes: digest_share), not read again."""
    known = known or {}
    files = {file: known.get(file) or file_digest(folder / file) for file in folder_files(folder)}
    write_json(folder / MANIFEST_FILE, {"checkpoint": name, "files": files, "sha256": list_digest(name, files)})


def listed_files(checkpoint: Path, state: dict[str, Any], check_name: bool = True) -> tuple[dict[str, Any], bool]:
    """The files a checkpoint's manifest lists (name -> size and SHA-256), and whether that manifest covers the
    whole folder (manifest.json) or, in checkpoints written before it existed, every file but trainer_state.json
    (its "manifest" entry; none at all in the oldest). CheckpointError when manifest.json is missing or damaged."""
    path = checkpoint / MANIFEST_FILE
    if not path.is_file():
        if state.get("manifest") == MANIFEST_FILE:
            raise CheckpointError(f"{path} is missing")
        return state.get("manifest", {}), False
    data = read_json(path)
    files, name = (data.get("files"), data.get("checkpoint")) if isinstance(data, dict) else (None, None)
    if not isinstance(files, dict) or list_digest(name, files) != data.get("sha256"):
        raise CheckpointError(f"{path} is damaged: its checksum does not match the list of files it holds, so "
                              "the manifest itself changed since the save")
    if check_name and name != checkpoint.resolve().name:  # a symlink or "." names the folder it points to
        raise CheckpointError(f"{path} is the manifest of {name}, not of {checkpoint.name}")
    return files, True


def damage(checkpoint: Path, check_name: bool = True) -> str | None:
    """What is wrong with a checkpoint (its state file unreadable, its manifest missing or damaged, a listed file
    missing, resized or changed, a file the manifest does not list), or None when the folder matches the
    manifest written at save time."""
    try:
        listed, whole = listed_files(checkpoint, read_state(checkpoint), check_name)
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
    extra = [name for name in folder_files(checkpoint) if name not in listed] if whole else []
    return f"{checkpoint / extra[0]} was not part of the saved checkpoint (not in its manifest)" if extra else None


def newest_verified(output_dir: str | Path, before: Path | None = None) -> Path | None:
    """The newest complete checkpoint that verifies (older than `before` when given)."""
    dirs = checkpoint_dirs(output_dir)
    if before is not None:
        dirs = [d for d in dirs if _step(d) < _step(before)]
    return next((d for d in reversed(dirs) if damage(d) is None), None)


def _step(checkpoint: Path) -> int:
    match = CHECKPOINT_PATTERN.match(checkpoint.name)
    return int(match.group(1)) if match else -1


class Stateful(Protocol):
    """A part of a run's state: `save` writes this process's files into the staging folder and returns what goes
    into trainer_state.json under the part's name (process 0's; None: nothing); `load` reads them back."""

    def save(self, folder: Path) -> Any: ...

    def load(self, folder: Path, saved: Any) -> None: ...


class RandomState:
    """Every RNG of this process (python, numpy, torch, CUDA): rng_state_<rank>.pt."""

    per_process = True  # not read by a run with another number of processes (Checkpointer.load)

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def save(self, folder: Path) -> None:
        torch.save(rng_state(), folder / f"rng_state_{self.rank}.pt")

    def load(self, folder: Path, saved: Any) -> None:
        set_rng_state(torch.load(folder / f"rng_state_{self.rank}.pt", weights_only=False))


class Checkpointer:
    """checkpoint-<step> folders under output_dir (atomic, verified, rotated), the resume choice, the final and
    best model exports, and the output_dir lock. `comm`: the run's processes (process 0 publishes; every process
    writes its own files)."""

    def __init__(self, args, comm) -> None:
        self.args, self.comm = args, comm

    @contextmanager
    def holding_output_dir(self) -> Iterator[None]:
        """Hold output_dir's OutputLock (process 0) for the block; every process raises the same ConfigError when
        another run holds it."""
        lock = OutputLock(self.args.output_dir)
        problem = lock.acquire() if self.comm.is_main else None
        problem = next((p for p in self.comm.gather(problem) if p is not None), None)
        if problem is not None:
            lock.release()
            raise ConfigError(problem)
        try:
            yield
        finally:
            lock.release()

    def _together(self, action: Callable[[], Any] | None, what: str, path: Path, kept: str) -> None:
        """Run `action` on this process (None: nothing here), then raise the same SaveError on every process when
        a write failed on any: the others never wait for it in a barrier, and every process names the path, the
        failing process's error and the free space. Errors that are not write errors are raised as they are."""
        error = None
        try:
            if action is not None:
                action()
        except Exception as exc:  # noqa: BLE001 - write errors become SaveErrors, the rest are re-raised
            if not is_write_error(exc):
                raise
            error = exc
        texts = self.comm.gather(None if error is None else f"{type(error).__name__}: {error}")
        failed = [(rank, text) for rank, text in enumerate(texts) if text is not None]
        if failed:
            rank, text = failed[0]
            raise save_error(what, path, text + (f" (process {rank})" if self.comm.size > 1 else ""), kept) from error

    def save(self, step: int, parts: dict[str, Stateful]) -> Path:
        """checkpoint-<step>: every process writes its parts into the staging folder, then process 0 writes
        trainer_state.json and manifest.json and renames the folder into place. On a failed write the staging
        folder is removed and every process raises the same SaveError; earlier checkpoints stay as they were."""
        comm, out = self.comm, Path(self.args.output_dir)
        staging, saved = staging_dir(out, step), {}
        what, kept = f"Saving checkpoint-{step}", "Earlier checkpoints are unchanged; free some space and resume."
        main = comm.is_main
        try:
            self._together(lambda: fresh_folder(staging) if main else None, what, staging, kept)
            self._together(lambda: saved.update((name, part.save(staging)) for name, part in parts.items()),
                           what, staging, kept)
            digests: dict[str, Any] = {}
            self._together(lambda: digests.update(digest_share(staging, comm.rank, comm.size)), what, staging, kept)
            known = {file: digest for share in comm.gather(digests) for file, digest in share.items()}
            self._together(lambda: self._seal(staging, saved, step, known) if main else None, what, staging, kept)
        except SaveError:
            if main:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        return out / f"checkpoint-{step}"

    def _seal(self, staging: Path, saved: dict[str, Any], step: int, known: dict[str, Any]) -> None:
        """trainer_state.json, then manifest.json (last: it covers every other file; `known`: the digests the
        processes took of the parts' files), then the rename."""
        state = {name: value for name, value in saved.items() if value is not None}
        state["num_processes"] = self.comm.size
        state["manifest"] = MANIFEST_FILE  # a checkpoint whose manifest.json is missing is then named as damaged
        write_json(staging / STATE_FILE, state)
        write_manifest(staging, f"checkpoint-{step}", known)
        publish(staging, self.args.output_dir, step, self.args.save_total_limit)

    def load(self, checkpoint: Path, parts: dict[str, Stateful]) -> None:
        """Every part from `checkpoint`. Written by another number of processes, the parts kept per process
        (`per_process`: random states, the partly used generation batch) are not read: the run goes on from the
        same step, data position, weights and optimizer state (re-sharded or loaded whole), but not bit-exactly."""
        saved = read_state(checkpoint)
        written = saved.get("num_processes", self.comm.size)
        if written != self.comm.size and self.comm.is_main:
            logger.warning(
                "%s was written by %d processes and resumes with %d: the weights and optimizer state are read into "
                "this run's processes; the processes' saved random states are not read (completions are seeded per "
                "sample, so they do not change)%s%s.", checkpoint, written, self.comm.size,
                ", nor the partly used generation batch: its remaining micro-batches are skipped"
                if any(checkpoint.glob("experience_*.pt")) else "",
                ", nor the generation batches made ahead (asynchronous rollouts): their prompts are skipped"
                if any(checkpoint.glob("rollouts_*.pt")) else "")
        for name, part in parts.items():
            if written == self.comm.size or not getattr(part, "per_process", False):
                part.load(checkpoint, saved.get(name))
        if self.comm.is_main:
            from grpokit.observe.metrics import trim_jsonl

            for name in ("metrics.jsonl", "completions.jsonl"):
                trim_jsonl(Path(self.args.output_dir) / name, saved["trainer"]["global_step"])
        logger.info("Resumed from %s at step %d.", checkpoint, saved["trainer"]["global_step"])

    def resume_path(self, resume: bool | str | None) -> Path | None:
        """The checkpoint to resume from (None: a new run, whose old metrics files are removed), verified."""
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
        return self.verified_once(checkpoint, picked_newest=resume is True)

    def verified_once(self, checkpoint: Path, picked_newest: bool) -> Path:
        """`verified` on process 0 only (it reads and hashes every file of the checkpoint, every process's shards
        included), its answer or its CheckpointError given to every process."""
        outcome = None
        if self.comm.is_main:
            try:
                outcome = (True, str(self.verified(checkpoint, picked_newest)))
            except CheckpointError as exc:
                outcome = (False, str(exc))
        ok, text = self.comm.gather(outcome)[0]
        if not ok:
            raise CheckpointError(text)
        return Path(text)

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

    def save_model(self, folder: str | Path, write: Callable[[Path], None]) -> None:
        """The model and tokenizer into `folder` (write(staging) writes them), atomically: written to a staging
        folder beside it, then each file renamed into place, so a failed save (a full disk) leaves the previous
        files as they were and raises a SaveError on every process."""
        comm, folder = self.comm, Path(folder)
        staging = folder.parent / f".{folder.name}.model-staging"
        comm.barrier()
        try:
            self._together(lambda: replace_files(folder, staging, write) if comm.is_main else None,
                           "Saving the model", folder, "The files already in that folder are unchanged; free some "
                           "space and call save_model again, or resume from the newest checkpoint.")
        finally:
            if comm.is_main:
                shutil.rmtree(staging, ignore_errors=True)

    def track_best(self, result: dict[str, float], state, write: Callable[[Path], None],
                   gathered: Callable[[], Any] = nullcontext) -> None:
        """Save the model to OUTPUT_DIR/best (write(folder) writes it, with best.json) when the evaluation improved
        metric_for_best_model; state.best_metric / best_model_checkpoint record it once it is saved. `gathered`:
        a context every process enters before process 0 writes (FSDP gathers the weights there)."""
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
        folder, staging = Path(args.output_dir) / "best", Path(args.output_dir) / ".best-staging"

        def write_best() -> None:
            fresh_folder(staging)
            write(staging)
            write_json(staging / "best.json", {"step": state.global_step, key: value})
            swap_in(staging, folder)

        try:
            with gathered():
                self._together(write_best if comm.is_main else None, "Saving the best model", folder,
                               "The previous best model is unchanged; free some space and resume.")
        finally:
            if comm.is_main:
                shutil.rmtree(staging, ignore_errors=True)
        state.best_metric, state.best_model_checkpoint = value, str(folder)

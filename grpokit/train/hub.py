"""push_to_hub: publishing the trained model to a local folder or a Hugging Face Hub repository."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from grpokit.errors import writing

logger = logging.getLogger("grpokit")

LOCAL_PREFIXES = ("/", "./", "../", "~", "file://")


def model_files(output_dir: Path) -> list[Path]:
    """The files push_to_hub publishes: OUTPUT_DIR's top-level files (weights, config, tokenizer, metrics),
    without checkpoints, the best model's folder or tracker runs."""
    return sorted(p for p in output_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def push_model(output_dir: str, target: str | None, private: bool | None = None) -> str:
    """Publish output_dir's model files to `target` (default: output_dir's folder name, as a hub repository).
    A local target gets a copy, staged and then moved into place, so a reader never sees half a model; a hub
    target is created if missing and uploaded in one commit. Returns where the model went."""
    folder = Path(output_dir)
    target = target or folder.resolve().name
    files = model_files(folder)
    if target.startswith(LOCAL_PREFIXES):
        destination = Path(target.removeprefix("file://")).expanduser()
        copy_model(files, destination)
        return str(destination)
    from huggingface_hub import create_repo, upload_folder

    repo = create_repo(target, private=private, exist_ok=True)
    upload_folder(repo_id=repo.repo_id, folder_path=str(folder), allow_patterns=[p.name for p in files],
                  commit_message="grpokit: trained model")
    return f"https://huggingface.co/{repo.repo_id}"


def copy_model(files: list[Path], destination: Path) -> None:
    """Copy `files` into the folder `destination`, staged beside it and swapped in (grpokit.train.checkpointer's
    swap_in), so that a failed copy (a full disk: a SaveError naming the folder and the free space) leaves the
    previous copy as it was and no staging folder behind."""
    from grpokit.train.checkpointer import fresh_folder, swap_in

    staging = destination.with_name(f".{destination.name}.staging")
    kept = f"The model in {files[0].parent if files else 'output_dir'} and any earlier copy are unchanged."
    try:
        with writing("Copying the model", destination, kept):
            destination.parent.mkdir(parents=True, exist_ok=True)
            fresh_folder(staging)
            for path in files:
                shutil.copy2(path, staging / path.name)
            swap_in(staging, destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def try_push(output_dir: str, target: str | None, private: bool | None) -> str | None:
    """push_model, logging instead of raising: a failed push must not lose or hide the model saved locally."""
    try:
        where = push_model(output_dir, target, private)
    except Exception as exc:  # noqa: BLE001 - any failure (network, auth, disk) is reported the same way
        logger.error("push_to_hub to %r failed: %s: %s. The trained model is in %s; push it later with "
                     "`hf upload %s %s`.", target, type(exc).__name__, exc, output_dir, target or "REPO", output_dir)
        return None
    logger.info("Pushed the model to %s.", where)
    return where

"""The trackers `report_to` may name: TRACKERS is the only list of them, read by the config's check (names and
installed packages, grpokit.config.checks), by `grpo train --help`, and by grpokit.observe.metrics to start one.

Each is one of accelerate's (`accelerate.tracking`), imported only when a run starts it: "tensorboard" ->
TensorBoardTracker writing to OUTPUT_DIR/runs/<run_name>, "wandb" -> WandBTracker, "trackio" -> TrackioTracker,
the last two in the project WANDB_PROJECT / TRACKIO_PROJECT (default "grpokit"). Any other accelerate tracker is
passed in report_to as an object (an accelerate.tracking.GeneralTracker) instead of a name.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

from grpokit.registry import Registry

DEFAULT_PROJECT = "grpokit"  # wandb / trackio project when WANDB_PROJECT / TRACKIO_PROJECT is not set


class Tracker(NamedTuple):
    """A tracker name's entry: the packages that provide it (any one will do), the one to install, and
    start(run_name, output_dir, first_step) -> an accelerate GeneralTracker."""

    packages: tuple[str, ...]
    install: str
    start: Callable[[str, Path, int], Any]


def _tensorboard(run_name: str, output_dir: Path, first_step: int) -> Any:
    from accelerate.tracking import TensorBoardTracker

    # A resumed run writes into the same folder: purge_step makes TensorBoard hide the points the interrupted run
    # logged after the last row metrics.jsonl kept (the trainer trims it to the checkpoint first).
    return TensorBoardTracker(run_name, output_dir / "runs", purge_step=first_step)


def _wandb(run_name: str, output_dir: Path, first_step: int) -> Any:
    from accelerate.tracking import WandBTracker

    return WandBTracker(os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, name=run_name)


def _trackio(run_name: str, output_dir: Path, first_step: int) -> Any:
    from accelerate.tracking import TrackioTracker

    return TrackioTracker(os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT, name=run_name)


TRACKERS = Registry("report_to", import_paths=False)
# torch's SummaryWriter needs tensorboard; accelerate falls back to tensorboardX when torch.utils.tensorboard cannot
# import.
TRACKERS.register("tensorboard", Tracker(("tensorboard", "tensorboardX"), "tensorboard", _tensorboard))
TRACKERS.register("wandb", Tracker(("wandb",), "wandb", _wandb))
TRACKERS.register("trackio", Tracker(("trackio",), "trackio", _trackio))


def tracker_installed(name: str) -> bool:
    """Whether a package that provides tracker `name` can be imported."""
    return any(importlib.util.find_spec(module) is not None for module in TRACKERS[name].packages)


def is_tracker(entry: Any) -> bool:
    """A tracker object: an accelerate GeneralTracker, or anything with the same callable `log(values, step=)`
    (GeneralTracker's own `log` is such a method, so this needs no accelerate import)."""
    return callable(getattr(entry, "log", None))


def report_to_problems(report_to: Any) -> list[str]:
    """The one check of report_to: a message for each entry that is neither an installed tracker's name nor a
    tracker object."""
    if not isinstance(report_to, list):
        return [f"report_to={report_to!r} should be a list of tracker names, one name, 'all' or 'none'."]
    problems = []
    for entry in report_to:
        if not isinstance(entry, str):
            if not is_tracker(entry):
                problems.append(f"report_to entry {entry!r} is neither a tracker name nor a tracker object (an "
                                "accelerate.tracking.GeneralTracker).")
        elif entry not in TRACKERS:
            problems.append(
                f"report_to entry {entry!r} is not a tracker grpokit knows; {TRACKERS.choices_text()}, or pass any "
                "other accelerate tracker as an object (an accelerate.tracking.GeneralTracker)."
            )
        elif not tracker_installed(entry):
            problems.append(f"report_to includes {entry!r} but it is not installed: pip install {TRACKERS[entry].install}")
    return problems

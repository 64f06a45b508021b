"""Where metrics go: metrics.jsonl (always), completions.jsonl, the trackers of `report_to`, and the progress display.

Each metric is defined, with its formula, in docs/metrics.md. Values arrive as tensors or numbers; `.item()`
happens here, once per logged step.

Trackers are accelerate's (`accelerate.tracking`), started by name from grpokit.observe.trackers.TRACKERS (the only list of
the names); an entry of `report_to` may also be a tracker object (an `accelerate.tracking.GeneralTracker`), used as
given. metrics.jsonl stays the source of truth: it is written first, and the trackers get the row's numbers only
(docs/metrics.md, "Trackers").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
from accelerate.state import PartialState

from grpokit.errors import ConfigError, problems_message, writing
from grpokit.observe.trackers import TRACKERS, report_to_problems

logger = logging.getLogger("grpokit")


def check_sinks(report_to: list[Any]) -> None:
    """The config's check of report_to (grpokit.observe.trackers.report_to_problems), again: for options changed after the
    GRPOConfig was built. ConfigError when a tracker is unknown or not installed, or an entry is not a tracker."""
    problems = report_to_problems(report_to)
    if problems:
        raise ConfigError(problems_message(problems))


def to_number(value: Any) -> Any:
    """A tensor or numpy scalar -> a Python number; anything else as it is."""
    if isinstance(value, torch.Tensor) or (
        not isinstance(value, (int, float, str, bytes, list, tuple, dict)) and callable(getattr(value, "item", None))
    ):
        value = value.item()
    return value


def tracker_values(row: dict[str, Any]) -> dict[str, float | int]:
    """The numbers of a clean row, for the trackers: `step` (passed as the step) and values that are not numbers
    (None, strings, lists) are left out; bools become 0/1; NaN and inf stay floats."""
    values = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, bool):
            values[key] = int(value)
        elif isinstance(value, (int, float)):
            values[key] = value
    return values


def tracker_config(config: dict[str, Any]) -> dict[str, bool | int | float | str | None]:
    """The run's settings as GeneralTracker.store_init_configuration takes them: bool, int, float, str or None.
    Lists and dicts become their JSON text; other objects (a tracker in report_to, a callable) their str()."""
    values = {}
    for key, value in config.items():
        if value is None or isinstance(value, (bool, int, float, str)):
            values[str(key)] = value
        elif isinstance(value, (list, tuple, dict)):
            values[str(key)] = json.dumps(value, default=str)
        else:
            values[str(key)] = str(value)
    return values


def trim_jsonl(path: Path, max_step: int) -> None:
    """Drop rows logged after `max_step` (by a run that died after its last checkpoint) before appending."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line]
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:  # torn by a kill in the middle of an append: only the last line can be
            lines.pop()
    kept = [line for line in lines if json.loads(line).get("step", 0) <= max_step]
    tmp = path.with_suffix(".tmp")
    with writing("Writing the rows up to the checkpoint", path, "It is unchanged; free some space and resume again."):
        try:
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)


APPEND_KEPT = "The rows already in it are unchanged; free some space and resume from the newest checkpoint."


def append_lines(path: Path, lines: list[str]) -> None:
    """Append whole lines to a JSONL file in one write. A failed write (a full disk, a vanished folder) is undone,
    so the file never ends in half a row, and raised as a SaveError naming the file and the free space."""
    data = memoryview("".join(line + "\n" for line in lines).encode())
    with writing("Appending rows", path, APPEND_KEPT):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data):]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)  # the rows before stay whole
                raise
        finally:
            os.close(fd)


class MetricsWriter:
    """Appends rows to metrics.jsonl / completions.jsonl and forwards them to the trackers (main process only).

    `report_to` holds tracker names (grpokit.observe.trackers.TRACKERS) and/or tracker objects. Each tracker is
    started and given the run's settings (`config`) here, gets every row's numbers in `log`, and is finished in
    `close`. `run_name` (else config["run_name"], else the output_dir's folder name) names the run: tensorboard
    writes to OUTPUT_DIR/runs/<run_name>; wandb and trackio name the run so, in the project WANDB_PROJECT /
    TRACKIO_PROJECT (default "grpokit"). Tracker objects are used as given (their own names and settings).
    """

    def __init__(
        self, output_dir: str, report_to: list[Any], config: dict[str, Any], *, run_name: str | None = None
    ) -> None:
        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.completions_path = self.dir / "completions.jsonl"
        self.run_name = run_name or config.get("run_name") or self.dir.resolve().name or "grpo"
        self.trackers: list[Any] = []
        settings = tracker_config(config)
        if report_to:
            PartialState()  # accelerate's trackers log through accelerate's logger, which needs its state
        try:
            for entry in report_to:
                tracker = _make_tracker(entry, self) if isinstance(entry, str) else entry
                if callable(getattr(tracker, "start", None)):
                    tracker.start()
                self.trackers.append(tracker)
                if callable(getattr(tracker, "store_init_configuration", None)):
                    tracker.store_init_configuration(settings)
        except BaseException:
            self.close()
            raise

    def log(self, row: dict[str, Any]) -> dict[str, Any]:
        clean = {key: to_number(value) for key, value in row.items()}
        append_lines(self.metrics_path, [json.dumps(clean)])
        if self.trackers:
            values = tracker_values(clean)
            for tracker in self.trackers:
                tracker.log(values, step=clean.get("step"))
        return clean

    def log_completions(self, rows: list[dict[str, Any]]) -> None:
        append_lines(self.completions_path, [json.dumps(row) for row in rows])

    def close(self) -> None:
        """Finish every tracker (once); one that fails to finish is reported, not raised, so it cannot hide the
        error that ended training nor keep the others from finishing."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            finish = getattr(tracker, "finish", None)
            if not callable(finish):
                continue
            try:
                finish()
            except Exception as exc:  # noqa: BLE001 - reported, see the docstring
                logger.warning("Tracker %s did not finish cleanly: %r", getattr(tracker, "name", tracker), exc)


def _make_tracker(name: str, writer: MetricsWriter) -> Any:
    check_sinks([name])
    return TRACKERS[name].start(writer.run_name, writer.dir, _last_step(writer.metrics_path) + 1)


def _last_step(path: Path) -> int:
    """The step of the last readable row of a metrics.jsonl, 0 when there is none."""
    if not path.is_file():
        return 0
    for line in reversed(path.read_text().splitlines()):
        try:
            return int(json.loads(line).get("step", 0))
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            continue
    return 0


class Progress:
    """A tqdm bar with reward, KL and step time, or one plain line per logged step when not on a TTY."""

    def __init__(self, total: int, initial: int, disable_bar: bool) -> None:
        self.bar = None
        if not disable_bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="grpo", dynamic_ncols=True)
        self.total = total

    def update(self, row: dict[str, float | int], advanced: int) -> None:
        summary = {
            "reward": f"{row.get('reward', float('nan')):.3f}",
            "kl": f"{row.get('kl', 0.0):.4f}",
            "s/step": f"{row.get('step_seconds', 0.0):.2f}",
        }
        if self.bar is not None:
            self.bar.set_postfix(summary, refresh=False)
            self.bar.update(advanced)
        else:
            text = " ".join(f"{k}={v}" for k, v in summary.items())
            print(f"step {row['step']}/{self.total} {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

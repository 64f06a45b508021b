"""Where metrics go: metrics.jsonl (always), completions.jsonl, optional sinks, and the progress display.

Each metric is defined, with its formula, in docs/metrics.md. Values arrive as tensors or numbers; `.item()`
happens here, once per logged step.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_sinks(report_to: list[str]) -> None:
    """Fail before training when a requested sink's package is missing."""
    for sink in report_to:
        if importlib.util.find_spec(SINK_PACKAGES[sink]) is None:
            raise ImportError(f"report_to includes {sink!r} but it is not installed: pip install {SINK_PACKAGES[sink]}")


def to_number(value: Any) -> float | int:
    if isinstance(value, torch.Tensor):
        value = value.item()
    return value


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
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class MetricsWriter:
    """Appends rows to metrics.jsonl / completions.jsonl and forwards them to the sinks (main process only)."""

    def __init__(self, output_dir: str, report_to: list[str], config: dict[str, Any]) -> None:
        self.dir = Path(output_dir)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.completions_path = self.dir / "completions.jsonl"
        self.sinks = [_open_sink(name, output_dir, config) for name in report_to]

    def log(self, row: dict[str, Any]) -> dict[str, float | int]:
        clean = {key: to_number(value) for key, value in row.items()}
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(clean) + "\n")
        for sink in self.sinks:
            sink(clean)
        return clean

    def log_completions(self, rows: list[dict[str, Any]]) -> None:
        with open(self.completions_path, "a") as handle:
            for row in rows:
                handle.write(json.dumps(row) + "\n")

    def close(self) -> None:
        for sink in self.sinks:
            getattr(sink, "close", lambda: None)()


def _open_sink(name: str, output_dir: str, config: dict[str, Any]):
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(Path(output_dir) / "runs"))

        def tensorboard(row):
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, row["step"])
            writer.flush()

        tensorboard.close = writer.close
        return tensorboard
    module = __import__(name)  # wandb and trackio share init/log/finish
    run = module.init(config=config)

    def remote(row):
        module.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    remote.close = getattr(run, "finish", getattr(module, "finish", lambda: None))
    return remote


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

"""Telemetry: one metrics row per optimizer step, from StepStats and the batch, reduced in ONE collective.

    row = telemetry.step_row(stats, state, fresh)    # fresh: the new batches, (ScoredBatch, Prepared, Experience, tokens)
    logged = telemetry.window_row(window, state)     # every logging_steps: the window's mean ...
    telemetry.publish(logged)                        # ... to metrics.jsonl, the trackers, the health monitor

Every process sends its local numbers (the loss, token-weighted sums, the mismatch statistics of a new batch,
its completions when the log is due) in one gather; the batch's own numbers (rewards, lengths, tool calls) were
already exchanged by the collector. The generation metrics of a batch are computed at its first step and kept
(and checkpointed) for the steps that reuse it. Metric names are TRL's where TRL has the metric; docs/metrics.md
defines each one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
from typing import Any

import torch

from grpokit.config import GRPOConfig
from grpokit.observe.health import HealthMonitor
from grpokit.observe.metrics import MetricsWriter, Progress, to_number
from grpokit.rewards import RewardError
from grpokit.train.batches import Experience, Prepared, ScoredBatch, StepStats, TrainerState
from grpokit.train.comm import Comm
from grpokit.vision.images import thumbnail_uri

logger = logging.getLogger("grpokit")

# Metrics whose logged value over several steps is the last one or the largest, not the mean
_LAST_VALUE = {"learning_rate", "num_tokens", "nonfinite_skips", "entropy_coef", "async/dropped"}
_LARGEST = {"nonfinite_skipped"}


class Telemetry:
    """Step rows, window means, the completions log, health alarms and the progress display of one run."""

    def __init__(self, args: GRPOConfig, comm: Comm, train_dataset, reward_names: list[str],
                 reward_weights: torch.Tensor, agentic: bool) -> None:
        self.args, self.comm, self.train_dataset, self.agentic = args, comm, train_dataset, agentic
        self.reward_names, self.reward_weights = reward_names, reward_weights
        self.batch_metrics: dict[str, float] = {}  # the current batch's generation metrics
        self.recent_completions: list[dict[str, Any]] = []
        self.writer: MetricsWriter | None = None
        self.progress: Progress | None = None
        self.health: HealthMonitor | None = None

    # ------------------------------------------------------------------ a run's sinks
    def open(self, state: TrainerState) -> None:
        """Start the files, trackers, health monitor and progress display (process 0)."""
        if not self.comm.is_main:
            return
        self.health = self.health_monitor(state)
        self.writer = MetricsWriter(self.args.output_dir, self.args.report_to, tracker_config(self.args))
        self.progress = Progress(state.max_steps, state.global_step, self.args.disable_tqdm)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.progress.close()
        self.writer = self.progress = None

    def health_monitor(self, state: TrainerState) -> HealthMonitor:
        """Run-health alarms (grpokit/observe/health.py) over the logged rows; a resumed run replays its history first,
        so an alarm raised before the checkpoint is not raised again."""
        args = self.args
        lower = (eval_key(args.metric_for_best_model),) if args.metric_for_best_model and \
            args.greater_is_better is False else ()
        monitor = HealthMonitor(beta=0.0 if args.kl_in_reward else args.beta, lower_is_better=lower,
                                reward_weights=dict(zip(self.reward_names, self.reward_weights.tolist())))
        for row in state.log_history:
            monitor.update(row)
        return monitor

    def write(self, row: dict[str, Any]) -> None:
        """A row to metrics.jsonl and the trackers; new health alarms become warnings."""
        if self.writer is not None:
            for alarm in self.health.update(self.writer.log(row)):
                logger.warning("%s", alarm)

    # ------------------------------------------------------------------ rows
    def step_row(self, stats: StepStats, state: TrainerState, fresh: list[tuple]) -> dict[str, Any]:
        """This step's metrics (numbers), on every process: the step's own and its generation metrics, those of the
        batches it started (`fresh`: (ScoredBatch, Prepared, Experience, num_tokens after it) each; several
        combined as window_mean combines steps) or, when it started none, those of the batch it still trains on."""
        local: dict[str, Any] = {"loss": stats.loss.cpu(), "bonus": None if stats.bonus is None else stats.bonus.cpu(),
                                 "token_sums": {key: value.cpu() for key, value in stats.token_sums.items()},
                                 "mismatch": [{k: float(v.detach().float()) for k, v in prepared.mismatch.items()}
                                              for _, prepared, _, _ in fresh],
                                 "records": [r for batch, _, experience, _ in fresh
                                             for r in self.completion_records(batch, experience, state.global_step + 1)]}
        everyone = self.comm.gather(local)  # the step's one collective
        if fresh:
            self.batch_metrics = window_mean([
                self.generation_metrics(batch, prepared, tokens, [part["mismatch"][k] for part in everyone])
                for k, (batch, prepared, _, tokens) in enumerate(fresh)])
            if self.writer is not None and self.completions_due(state.global_step + 1):
                self.writer.log_completions([record for part in everyone for record in part["records"]])
        sums: dict[str, torch.Tensor] = {}
        for part in everyone:
            for key, value in part["token_sums"].items():
                sums[key] = sums[key] + value if key in sums else value
        tokens = sums.pop("tokens").clamp(min=1.0)
        out: dict[str, Any] = {key: value / tokens for key, value in sums.items()}
        out["loss"] = sum(part["loss"] for part in everyone) / len(everyone)  # DDP averages gradients
        if stats.bonus is not None:  # policy_loss: the loss without the entropy bonus (loss = policy_loss - bonus)
            out["policy_loss"] = sum(part["loss"] + part["bonus"] for part in everyone) / len(everyone)
        out["grad_norm"] = stats.grad_norm
        out["nonfinite_skipped"] = int(stats.skipped)
        out["nonfinite_skips"] = state.nonfinite_skips
        if self.args.entropy_coef != 0.0 or self.args.use_adaptive_entropy:
            out["entropy_coef"] = state.entropy_coef
        return {k: to_number(v) for k, v in {**self.batch_metrics, **out}.items()}

    def generation_metrics(self, batch: ScoredBatch, prepared: Prepared, num_tokens: int,
                           mismatch: list[dict[str, float]]) -> dict[str, float]:
        """A batch's metrics: rewards (per function too), completion lengths, throughput, tool calls, the
        train/inference mismatch (`mismatch`: each process's), dynamic sampling, what reward functions logged with
        log_metric, and num_tokens (completion tokens generated up to this batch)."""
        stats = prepared.reward_stats or batch.reward_stats
        names = prepared.reward_names or self.reward_names
        lengths, truncated = batch.lengths.float(), batch.truncated.float()
        tokens = lengths.sum().item()
        metrics = {
            "reward": torch.nanmean(stats["reward"]).item(),
            "reward_std": stats["reward_group_std"].mean().item(),
            "frac_reward_zero_std": stats["frac_reward_zero_std"].item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.mean().item(),
            "tokens_per_second": tokens / max(batch.generation_seconds, 1e-9),
            "generation_seconds": batch.generation_seconds,
            "num_tokens": num_tokens,
        }
        for k, name in enumerate(names):
            if k in stats["step_reward_mean"]:  # a process function: the mean of its step rewards
                metrics[f"rewards/{name}/step_mean"] = stats["step_reward_mean"][k].item()
                continue
            metrics[f"rewards/{name}/mean"] = stats["reward_func_mean"][k].item()
            metrics[f"rewards/{name}/std"] = stats["reward_func_std"][k].item()
            if self.args.reward_error_policy == "none" and k < len(batch.failures):
                metrics[f"rewards/{name}/failures"] = batch.failures[k]
        if self.agentic:
            metrics.update(tool_metrics(batch.tool_stats))
        metrics.update(reduce_extremes(mismatch))
        metrics.update(batch.sampling_metrics)
        clash = sorted(set(batch.logged_metrics) & set(metrics))
        if clash:
            raise RewardError(f"log_metric({clash[0]!r}, ...) from a reward function: {clash[0]!r} is a metric the "
                              "trainer logs itself; give yours another name (e.g. 'rewards/my_" f"{clash[0]}').")
        metrics.update({name: sum(values) / len(values) for name, values in batch.logged_metrics.items() if values})
        return metrics

    def window_row(self, window: list[dict[str, float]], state: TrainerState) -> dict[str, float]:
        """The metrics row of the steps since the last one (their mean; see window_mean), on every process,
        appended to state.log_history."""
        row = {"step": state.global_step, "epoch": state.epoch, **window_mean(window)}
        state.log_history.append(row)
        return row

    def publish(self, row: dict[str, float]) -> None:
        """A logged row to the files and trackers, and the newest completions to stderr when asked."""
        self.write(row)
        if self.writer is not None and self.args.num_completions_to_print:
            self.print_completions()

    def log_due(self, step: int, max_steps: int) -> bool:
        args = self.args
        return step % args.logging_steps == 0 or step == max_steps or (args.logging_first_step and step == 1)

    # ------------------------------------------------------------------ completions
    def completions_due(self, step: int) -> bool:
        return self.args.log_completions and (step % self.args.completions_logging_steps == 0 or step == 1)

    def completion_records(self, batch: ScoredBatch, experience: Experience, step: int) -> list[dict[str, Any]]:
        """This process's completions of a new batch as completions.jsonl rows (when the log is due, or some are
        printed); the first num_completions_to_print are kept for printing."""
        due = self.completions_due(step)
        if not due and not self.args.num_completions_to_print:
            return []
        rows = batch.local_rows
        prompts = self.train_dataset[rows]["prompt"]
        advantages = experience.advantages
        # with step rewards the advantage is per token; its first token's holds every step's share
        first_token_advantages = advantages[:, 0] if advantages.dim() == 2 else advantages
        records = [
            {"step": step, "prompt": p, "completion": t,
             "rewards": {n: (None if math.isnan(v) else v) for n, v in zip(self.reward_names, r.tolist())},
             "advantage": a}
            for p, t, r, a in zip(prompts, batch.texts, batch.rewards[batch.local], first_token_advantages.tolist())
        ]
        for record, vision in zip(records, batch.vision or ()):  # each prompt's images, as small thumbnails
            if vision is not None:
                record["images"] = [thumbnail_uri(image) for image in vision.images]
        for column, values in batch.log_extra.items():  # log_extra columns, where they cover this batch
            if len(values) == len(records):
                for record, value in zip(records, values):
                    record.setdefault(column, value)
        if self.args.num_completions_to_print:
            self.recent_completions = records[: self.args.num_completions_to_print]  # this process's first rows
        return records if due else []

    def print_completions(self) -> None:
        """The first num_completions_to_print completions of the newest generation batch, to stderr."""
        for record in self.recent_completions:
            rewards = ", ".join(f"{name}={value}" for name, value in record["rewards"].items())
            print(f"[step {record['step']}] {record['prompt']!r} -> {record['completion']!r} ({rewards})",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, float]:
        return dict(self.batch_metrics)

    def load_state_dict(self, metrics: dict[str, float]) -> None:
        self.batch_metrics = dict(metrics)


def tool_metrics(stats: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Multi-turn rollouts, from episode_stats (N, 4): tools/call_frequency (tool calls per completion),
    tools/failure_frequency (failed calls / calls, 0 without calls), tools/turns_mean (model turns per episode),
    completions/tool_tokens_mean (tokens written by tools and environments per completion;
    completions/mean_length counts the model's)."""
    calls, failures, turns, tokens = stats.float().unbind(-1)
    return {
        f"{prefix}tools/call_frequency": calls.mean().item(),
        f"{prefix}tools/failure_frequency": (failures.sum() / calls.sum()).item() if calls.sum() > 0 else 0.0,
        f"{prefix}tools/turns_mean": turns.mean().item(),
        f"{prefix}completions/tool_tokens_mean": tokens.mean().item(),
    }


def reduce_extremes(parts: list[dict[str, float]]) -> dict[str, float]:
    """Every process's metrics -> one value each: keys ending /min or /max by min or max, others by the mean."""
    out = {}
    for key in parts[0] if parts else []:
        values = torch.tensor([part[key] for part in parts])
        value = values.min() if key.endswith("/min") else values.max() if key.endswith("/max") else values.mean()
        out[key] = value.item()
    return out


def window_mean(rows: list[dict[str, float]]) -> dict[str, float]:
    """One metrics row for the steps since the last logged one, as TRL logs: each metric's mean over the steps
    where it is a number (NaN: not applicable at that step, left out); counters and the learning rate keep their
    last value; minima (names ending in "/min" or "min_length") the smallest, maxima and nonfinite_skipped the
    largest."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [row[key] for row in rows if isinstance(row.get(key), (int, float)) and not isinstance(row[key], bool)]
        if not values:
            continue
        finite = [v for v in values if not math.isnan(v)] or [math.nan]
        if key in _LAST_VALUE:
            out[key] = values[-1]
        elif key.endswith(("/min", "min_length")):
            out[key] = min(finite)
        elif key.endswith(("/max", "max_length")) or key in _LARGEST:
            out[key] = max(finite)
        else:
            out[key] = sum(finite) / len(finite)
    return out


def summary_row(state: TrainerState, seconds: float, first_step: int, losses: list[float],
                completions_per_step: int) -> dict[str, float]:
    """TRL's last log_history row: train_loss (the mean loss of this call's steps), train_runtime (s),
    train_samples_per_second and train_steps_per_second (completions and optimizer steps per second)."""
    steps = state.global_step - first_step
    finite = [v for v in losses if not math.isnan(v)]
    return {
        "step": state.global_step, "epoch": state.epoch,
        "train_loss": sum(finite) / len(finite) if finite else math.nan,
        "train_runtime": seconds,
        "train_samples_per_second": steps * completions_per_step / max(seconds, 1e-9),
        "train_steps_per_second": steps / max(seconds, 1e-9),
    }


def eval_metric_summary(name: str, values: torch.Tensor, prefix: str = "eval/") -> dict[str, float]:
    """A compute_metrics function's eval results, values (prompts, G) with NaN where it returned None:
    <prefix>metrics/<name>/mean over the scored completions and, when every value is 0 or 1 (a correctness
    check), <prefix>metrics/<name>/pass@G: the fraction of prompts with at least one 1 among their G completions."""
    scored = values[~torch.isnan(values)]
    out = {f"{prefix}metrics/{name}/mean": scored.mean().item() if scored.numel() else math.nan}
    if scored.numel() and bool(((scored == 0) | (scored == 1)).all()):
        out[f"{prefix}metrics/{name}/pass@{values.shape[1]}"] = (values == 1).any(-1).float().mean().item()
    return out


def trl_metric_names(result: dict[str, Any], sets: list[str | None]) -> dict[str, Any]:
    """Eval metrics under TRL's names: eval/<x> -> eval_<x>, a named set's eval/<set>/<x> -> eval_<set>_<x>."""
    out = {}
    for key, value in result.items():
        if not key.startswith("eval/"):
            continue
        rest = key[len("eval/"):]
        named = next((n for n in sets if n is not None and rest.startswith(f"{n}/")), None)
        out[f"eval_{named}_{rest[len(named) + 1:]}" if named else f"eval_{rest}"] = value
    return out


def eval_key(name: str) -> str:
    """metric_for_best_model as a logged key: "reward", "eval/reward" and TRL's "eval_reward" -> "eval/reward"."""
    if name.startswith("eval/"):
        return name
    return "eval/" + name.removeprefix("eval_")


def tracker_config(args: GRPOConfig) -> dict[str, Any]:
    """The config as trackers store it (tracker objects in report_to by name)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    values["report_to"] = [r if isinstance(r, str) else type(r).__name__ for r in args.report_to]
    values["tools"] = [t if isinstance(t, str) else getattr(t, "__name__", repr(t)) for t in args.tools]
    return values

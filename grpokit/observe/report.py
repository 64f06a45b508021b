"""`grpo report OUTPUT_DIR`: one self-contained HTML page about a run, from its metrics.jsonl and completions.jsonl.

    write_report("outputs/run")                  # -> outputs/run/report.html
    write_report("outputs/run", steps=[10, 50])  # the best and worst completions of steps 10 and 50

The page has the run-health alarms of grpokit.observe.health with their evidence, one inline SVG chart per group of
metrics (drawn by grpokit.observe.charts; no script, stylesheet, font or image is fetched, and its
Content-Security-Policy forbids any fetch, so it opens offline and can be mailed), and
the best and worst completions of chosen steps. Alarms that the run's expected_alarms.json names (the tool demo
writes one) are shown as expected, with its reason. Every chart is a <figure class="plot" id="plot-..."
data-metric="..."> whose id does not change between runs; a metric the run did not log gives a figure marked
data-state="not-logged" instead of a chart. Every text from the run (prompts, completions, metric names) is
escaped. docs/report.md describes each chart and alarm.
"""

from __future__ import annotations

import fnmatch
import json
import re
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from grpokit.errors import write_text
# MAX_POINTS and decimate are not used here: importable from this module as before the charts moved out
from grpokit.observe.charts import COLORS, MAX_POINTS, Points, decimate, esc, svg_line_chart  # noqa: F401
from grpokit.observe.health import ALARM_TITLES, EXPECTED_ALARMS_FILE, Alarm, check_run

REPORT_NAME = "report.html"
EXAMPLES_PER_SIDE = 3  # best and worst completions shown per chosen step


class ReportError(Exception):
    """The run folder cannot be reported on; the message names the file and what writes it."""


@dataclass(frozen=True)
class Plot:
    """One chart: `keys` are metric names or fnmatch patterns (rewards/*/mean); `lines` are (y, label) guides;
    `optional`: left out of runs that log none of its keys (instead of a "not logged" panel)."""

    id: str
    title: str
    keys: tuple[str, ...]
    about: str
    lines: tuple[tuple[float, str], ...] = ()
    optional: bool = False


PLOTS = (
    Plot("reward", "Reward (total)", ("reward",), "Mean total reward of each step's generation batch."),
    Plot("rewards-per-function", "Reward per function", ("rewards/*/mean", "rewards/*/step_mean"),
         "Mean of each reward function over the completions it scored (step_mean: step rewards)."),
    Plot("reward-std-per-function", "Reward std per function", ("rewards/*/std",),
         "Std of each reward function over the batch; the reward-dominance alarm compares them (x weight)."),
    Plot("eval", "Evaluation", ("eval/*",), "Rewards on the eval prompts (after training, or every eval_steps)."),
    Plot("kl", "KL to the reference", ("kl",), "Per-token KL estimate between the policy and the reference."),
    Plot("entropy", "Entropy (nats/token)", ("entropy",), "Mean token entropy of the policy on its completions."),
    Plot("completion-length", "Completion length (tokens)",
         ("completions/mean_length", "completions/min_length", "completions/max_length"),
         "Mean, shortest and longest completion of each generation batch."),
    Plot("tool-calls", "Tool calls", ("tools/call_frequency", "tools/failure_frequency"),
         "Tool calls per episode, and the fraction of calls that failed (the model read an error).", optional=True),
    Plot("tool-turns", "Episode turns and tool tokens", ("tools/turns_mean", "completions/tool_tokens_mean"),
         "Model turns per episode; tokens written by tools and environments per episode (context, never in the "
         "loss).", optional=True),
    Plot("truncation", "Truncated completions", ("completions/clipped_ratio",),
         "Fraction of completions without EOS within max_completion_length.", ((0.05, "5% (alarm)"),)),
    Plot("clip", "Clip fractions", ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"),
         "Fractions of tokens whose importance weight was clipped (0 on a fresh batch)."),
    Plot("zero-std", "Groups with no learning signal", ("frac_reward_zero_std",),
         "Fraction of groups whose rewards were all equal (advantage 0).", ((0.9, "90% (alarm)"),)),
    Plot("advantage-spread", "Advantage spread", ("reward_std", "advantages/*", "advantage std (completions.jsonl)"),
         "reward_std: mean within-group std of the total reward (the advantages' scale before normalisation); "
         "advantage std: the std of the logged advantages at the steps completions.jsonl holds."),
    Plot("loss", "Loss", ("loss",), "The optimised loss; ~ beta*KL on a fresh batch, so watch reward instead."),
    Plot("learning-rate", "Learning rate", ("learning_rate",), "The scheduler's rate after each step."),
    Plot("grad-norm", "Gradient norm", ("grad_norm",), "Global L2 norm of the gradient before clipping."),
    Plot("step-time", "Step time (s)", ("step_seconds", "generation_seconds"),
         "Wall seconds of each step, and of its rollout."),
)
NOT_PLOTTED = {"step"}


@dataclass
class Run:
    """What the report reads: the metric rows, the completion rows, and notes about lines it skipped."""

    directory: Path
    metrics: list[dict[str, Any]]
    completions: list[dict[str, Any]] | None  # None: no completions.jsonl
    notes: list[str] = field(default_factory=list)
    expected: dict[str, str] = field(default_factory=dict)  # alarm kind -> why (expected_alarms.json)


def slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "metric"


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of a JSON-lines file and notes on skipped lines (a torn last line is what a killed run leaves)."""
    lines = path.read_text(errors="replace").splitlines()
    rows, notes = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            torn = number == len(lines)
            notes.append(f"{path.name} line {number}: " + ("torn last line (the run was stopped mid-write); skipped."
                                                           if torn else "not valid JSON; skipped."))
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            notes.append(f"{path.name} line {number}: not a JSON object; skipped.")
    return rows, notes


def load_run(output_dir: str | Path) -> Run:
    directory = Path(output_dir)
    if not directory.is_dir():
        raise ReportError(f"{directory} is not a folder: give the output_dir of a run (grpo train / GRPOTrainer).")
    metrics_path = directory / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(
            f"{metrics_path} not found: GRPOTrainer writes it during training (a row every logging_steps); "
            "is this the output_dir of a run that reached its first logged step?"
        )
    metrics, notes = read_jsonl(metrics_path)
    completions = None
    if (directory / "completions.jsonl").is_file():
        completions, more = read_jsonl(directory / "completions.jsonl")
        notes += more
    expected = read_expected(directory / EXPECTED_ALARMS_FILE, notes)
    return Run(directory, metrics, completions, notes, expected)


def read_expected(path: Path, notes: list[str]) -> dict[str, str]:
    """{alarm kind: why} from expected_alarms.json; {} without the file; a malformed one is noted and ignored."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError:
        data = None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        notes.append(f"{path.name}: not a JSON object of alarm kind -> reason; ignored.")
        return {}
    return data


def write_report(output_dir: str | Path, steps: Sequence[int] | None = None, output: str | Path | None = None) -> Path:
    """Write OUTPUT_DIR/report.html (or `output`) for the run in output_dir and return its path.

    steps: the steps whose best and worst completions are shown (default: the first, middle and last steps
    completions.jsonl holds). Raises ReportError when output_dir or its metrics.jsonl is missing, SaveError when
    the page cannot be written.
    """
    run = load_run(output_dir)
    path = Path(output) if output is not None else run.directory / REPORT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    # a reader never sees half a page; a failed write (a full disk) is a SaveError naming the path
    write_text(path, render(run, steps), "Writing the report", "An earlier report there is unchanged.")
    return path


# ---------------------------------------------------------------------------------------------- the page
def render(run: Run, steps: Sequence[int] | None = None) -> str:
    alarms = check_run(run.metrics, expected=run.expected)
    series = collect_series(run)
    body = "\n".join([
        f"<h1>GRPO run report</h1>\n<p class=\"dir\">{esc(run.directory)}</p>",
        summary_section(run, alarms),
        health_section(alarms),
        curves_section(series, alarms),
        completions_section(run, steps),
    ])
    return PAGE.format(style=STYLE, body=body)


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>GRPO run report</title>
<style>{style}</style>
</head>
<body>
{body}
</body>
</html>
"""

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1240px;
       color: #222; padding: 0 16px; }
h1 { margin-bottom: 0; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 32px; }
.dir { color: #666; margin-top: 4px; font-family: monospace; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(580px, 1fr)); gap: 18px; }
figure.plot { margin: 0; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px 12px; background: #fff; }
figure.plot h3 { margin: 0 0 4px; font-size: 15px; }
figure.plot figcaption { color: #555; font-size: 12px; }
figure.plot[data-state="not-logged"] { background: #fafafa; color: #888; }
.legend { list-style: none; padding: 0; margin: 4px 0 0; font-size: 12px; display: flex; flex-wrap: wrap;
          gap: 4px 14px; }
.legend span { display: inline-block; width: 12px; height: 3px; vertical-align: middle; margin-right: 4px; }
svg text { font: 11px system-ui, sans-serif; fill: #555; }
.alarms { list-style: none; padding: 0; }
.alarm { border-left: 5px solid #d62728; background: #fff5f5; padding: 8px 12px; margin: 10px 0; border-radius: 4px; }
.alarm[data-severity="info"] { border-color: #1f77b4; background: #f3f8fd; }
.alarm .advice { margin: 4px 0; }
.alarm details { font-size: 12px; color: #444; }
.ok { border-left: 5px solid #2ca02c; background: #f4fbf4; padding: 8px 12px; }
table { border-collapse: collapse; font-size: 13px; }
td, th { border: 1px solid #ddd; padding: 3px 8px; vertical-align: top; text-align: left; }
img.thumb { width: 64px; height: 64px; object-fit: contain; margin: 0 4px 4px 0; image-rendering: pixelated; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; font-size: 12px; max-height: 16em; overflow: auto; }
.notes li { color: #8a5a00; }
"""


def summary_section(run: Run, alarms: list[Alarm]) -> str:
    train = [r for r in run.metrics if "loss" in r or "reward" in r]
    if not run.metrics:
        facts = ["<p>metrics.jsonl has no rows yet: nothing was logged (the first row comes at step "
                 "logging_steps).</p>"]
    else:
        rewards = [r["reward"] for r in train if is_finite(r.get("reward"))]
        facts = [
            "<table>",
            row_html("logged steps", f"{len(train)} (last step {esc(last_step(run.metrics))})"),
            row_html("reward", f"{fmt(rewards[0])} at the first logged step, {fmt(rewards[-1])} at the last"
                     if rewards else "not logged"),
        ]
        for key in sorted({k for r in run.metrics for k in r if k.startswith("eval/")}):
            points = [(r.get("step"), r[key]) for r in run.metrics if is_finite(r.get(key))]
            if points:
                first = f"{fmt(points[0][1])} (step {esc(points[0][0])}) &rarr; " if len(points) > 1 else ""
                facts.append(row_html(esc(key), f"{first}{fmt(points[-1][1])} (step {esc(points[-1][0])})"))
        warnings, expected = sum(a.severity == "warning" for a in alarms), sum(bool(a.expected) for a in alarms)
        facts += [row_html("alarms", f"{warnings} warning(s), {len(alarms) - warnings} note(s)"
                           + (f", of which {expected} expected in this run" if expected else "")), "</table>"]
    notes = "".join(f"<li>{esc(n)}</li>" for n in run.notes)
    return "<section id=\"summary\"><h2>Summary</h2>" + "".join(facts) + (
        f"<ul class=\"notes\">{notes}</ul>" if notes else "") + "</section>"


def row_html(name: str, value: str) -> str:
    return f"<tr><th>{name}</th><td>{value}</td></tr>"


def last_step(rows: list[dict[str, Any]]) -> Any:
    steps = [r["step"] for r in rows if isinstance(r.get("step"), (int, float))]
    return max(steps) if steps else "?"


def health_section(alarms: list[Alarm]) -> str:
    if not alarms:
        return ("<section id=\"health\"><h2>Run health</h2><p class=\"ok\">No alarms: none of the checks in "
                "docs/report.md fired.</p></section>")
    items = "\n".join(alarm_html(a) for a in alarms)
    return f"<section id=\"health\"><h2>Run health</h2><ul class=\"alarms\">\n{items}\n</ul></section>"


def alarm_html(alarm: Alarm) -> str:
    rows = "".join(f"<tr><td>{esc(s)}</td><td>{esc(m)}</td><td>{fmt(v)}</td></tr>" for s, m, v in alarm.evidence)
    return (
        f"<li class=\"alarm\" data-alarm=\"{esc(alarm.kind)}\" data-severity=\"{esc(alarm.severity)}\" "
        f"data-expected=\"{'yes' if alarm.expected else 'no'}\" "
        f"data-step=\"{esc(alarm.step)}\" data-metric=\"{esc(alarm.metric)}\">"
        f"<strong>{esc(alarm.title)}</strong> at step {esc(alarm.step)} ({esc(alarm.severity)}): {esc(alarm.message)}"
        + (f"<p class=\"expected\">Expected in this run: {esc(alarm.expected)}</p>" if alarm.expected else "")
        + f"<p class=\"advice\">What to do{' when it is not expected' if alarm.expected else ''}: {esc(alarm.advice)}</p>"
        f"<details><summary>Evidence ({len(alarm.evidence)} values)</summary>"
        f"<table><tr><th>step</th><th>metric</th><th>value</th></tr>{rows}</table></details></li>"
    )


# ---------------------------------------------------------------------------------------------- curves
def collect_series(run: Run) -> dict[str, Points]:
    """Every numeric metric as (step, value) points in logged order; non-finite values become None (a gap)."""
    series: dict[str, Points] = {}
    for row in run.metrics:
        step = row.get("step")
        if not is_number(step):
            continue
        for key, value in row.items():
            if key in NOT_PLOTTED or not (value is None or is_number(value)):
                continue
            series.setdefault(key, []).append((float(step), float(value) if is_finite(value) else None))
    advantages = advantage_spread(run.completions or [])
    if advantages:
        series["advantage std (completions.jsonl)"] = advantages
    return series


def advantage_spread(rows: list[dict[str, Any]]) -> Points:
    by_step: dict[float, list[float]] = {}
    for row in rows:
        if is_number(row.get("step")) and is_finite(row.get("advantage")):
            by_step.setdefault(float(row["step"]), []).append(float(row["advantage"]))
    return [(s, statistics.pstdev(v)) for s, v in sorted(by_step.items())]


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return is_number(value) and math.isfinite(value)


def fmt(value: Any) -> str:
    if not is_number(value):
        return esc(value)
    return f"{value:.4g}" if math.isfinite(value) else esc(value)


def matching(patterns: Iterable[str], keys: Iterable[str]) -> list[str]:
    keys = list(keys)
    out = []
    for pattern in patterns:
        out += sorted(k for k in keys if fnmatch.fnmatchcase(k, pattern) and k not in out)
    return out


def curves_section(series: dict[str, Points], alarms: list[Alarm]) -> str:
    figures, used = [], set()
    for plot in PLOTS:
        keys = matching(plot.keys, series)
        if plot.optional and not keys:
            continue
        used.update(keys)
        figures.append(figure(plot, {k: series[k] for k in keys}, alarms))
    others: dict[str, list[str]] = {}
    for key in series:
        if key not in used:
            others.setdefault(key.split("/")[0], []).append(key)
    for group, keys in sorted(others.items()):
        plot = Plot(f"other-{slug(group)}", group, tuple(keys), "Also logged (docs/metrics.md).")
        figures.append(figure(plot, {k: series[k] for k in sorted(keys)}, alarms))
    return "<section id=\"curves\"><h2>Curves</h2><div class=\"plots\">\n" + "\n".join(figures) + "\n</div></section>"


def figure(plot: Plot, series: dict[str, Points], alarms: list[Alarm]) -> str:
    metric = next(iter(series), plot.keys[0])
    head = (f"<figure class=\"plot\" id=\"plot-{esc(plot.id)}\" data-metric=\"{esc(metric)}\" "
            f"data-series=\"{esc(json.dumps(list(series)))}\"")
    drawable = {k: v for k, v in series.items() if any(y is not None for _, y in v)}
    if not drawable:
        reason = "only None/NaN values" if series else "not logged in this run"
        return (f"{head} data-state=\"not-logged\"><h3>{esc(plot.title)}</h3>"
                f"<p>{esc(', '.join(series) or ', '.join(plot.keys))}: {reason}.</p></figure>")
    marks = [(a.step, a.title) for a in alarms if a.metric in series]
    gaps = sum(y is None for v in series.values() for _, y in v)
    caption = esc(plot.about) + (f" {gaps} None/NaN/inf value(s) are left as gaps." if gaps else "")
    legend = "".join(f"<li><span style=\"background:{COLORS[i % len(COLORS)]}\"></span>{esc(k)}</li>"
                     for i, k in enumerate(series))
    chart = svg_line_chart(series, lines=plot.lines, marks=marks, metric=metric)
    return (f"{head} data-state=\"drawn\"><h3>{esc(plot.title)}</h3>{chart}<ul class=\"legend\">{legend}</ul>"
            f"<figcaption>{caption}</figcaption></figure>")


# ---------------------------------------------------------------------------------------------- completions
def completions_section(run: Run, steps: Sequence[int] | None) -> str:
    head = "<section id=\"completions\"><h2>Best and worst completions</h2>"
    if run.completions is None:
        return head + ("<p>completions.jsonl not found: GRPOTrainer writes it when log_completions=True (at step 1 "
                       "and every completions_logging_steps).</p></section>")
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in run.completions:
        if isinstance(row.get("step"), int):
            by_step.setdefault(row["step"], []).append(row)
    if not by_step:
        return head + "<p>completions.jsonl holds no completions yet.</p></section>"
    logged = sorted(by_step)
    chosen = list(steps) if steps else sorted({logged[0], logged[len(logged) // 2], logged[-1]})
    text = ("<p>Ranked by the sum of the reward functions' values (None counts as nothing; reward_weights are "
            f"not applied). Steps with completions: {esc(', '.join(map(str, logged)))}.</p>")
    blocks = [step_block(step, by_step.get(step), logged) for step in chosen]
    return head + text + "\n".join(blocks) + "</section>"


def total_reward(row: dict[str, Any]) -> float | None:
    rewards = row.get("rewards")
    values = [v for v in rewards.values() if is_finite(v)] if isinstance(rewards, dict) else []
    return sum(values) if values else None


def step_block(step: int, rows: list[dict[str, Any]] | None, logged: list[int]) -> str:
    head = (f"<div class=\"step\" id=\"completions-step-{esc(step)}\" data-step=\"{esc(step)}\">"
            f"<h3>Step {esc(step)}</h3>")
    if not rows:
        return head + (f"<p>No completions were logged at step {esc(step)}; steps with completions: "
                       f"{esc(', '.join(map(str, logged)))}.</p></div>")
    count, rows = len(rows), distinct(rows)
    ranked = sorted(rows, key=lambda r: (total_reward(r) is None, -(total_reward(r) or 0.0)))
    if len(ranked) <= 2 * EXAMPLES_PER_SIDE:
        picked = [("", r) for r in ranked]
    else:
        scored = [r for r in ranked if total_reward(r) is not None] or ranked
        picked = [("best", r) for r in scored[:EXAMPLES_PER_SIDE]] + [
            ("worst", r) for r in scored[-EXAMPLES_PER_SIDE:]]
    names = sorted({n for r in rows if isinstance(r.get("rewards"), dict) for n in r["rewards"]})
    header = "".join(f"<th>{esc(n)}</th>" for n in names)
    body = "".join(completion_row(label, row, names) for label, row in picked)
    return (head + f"<p>{count} completions logged ({len(rows)} distinct).</p><table><tr><th></th><th>total</th>"
            f"{header}<th>advantage</th><th>prompt</th><th>completion</th></tr>{body}</table></div>")


def distinct(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (prompt, completion), with `copies`: a group often samples the same answer several times."""
    seen: dict[str, dict[str, Any]] = {}
    for row in rows:
        key = json.dumps([row.get("prompt"), row.get("images"), row.get("completion")], sort_keys=True, default=str)
        if key in seen:
            seen[key]["copies"] += 1
        else:
            seen[key] = {**row, "copies": 1}
    return list(seen.values())


def completion_row(label: str, row: dict[str, Any], names: list[str]) -> str:
    rewards = row.get("rewards") if isinstance(row.get("rewards"), dict) else {}
    total = total_reward(row)
    cells = "".join(f"<td>{fmt(rewards.get(n))}</td>" for n in names)
    copies = f" (x{row['copies']})" if row.get("copies", 1) > 1 else ""
    return (f"<tr class=\"completion {esc(label)}\"><td>{esc(label)}{copies}</td><td>{fmt(total)}</td>{cells}"
            f"<td>{fmt(row.get('advantage'))}</td><td>{thumbnails(row.get('images'))}"
            f"<pre>{esc(prompt_text(row.get('prompt')))}</pre></td>"
            f"<td><pre>{esc(row.get('completion', ''))}</pre></td></tr>")


# a PNG or JPEG data URI and nothing else: completions.jsonl is read as untrusted text
DATA_URI = re.compile(r"data:image/(png|jpeg);base64,[A-Za-z0-9+/]+={0,2}")


def thumbnails(images: Any) -> str:
    """A prompt's image thumbnails (completions.jsonl's `images`: PNG data URIs), each checked to be one."""
    if not isinstance(images, list):
        return ""
    return "".join(f"<img class=\"thumb\" alt=\"prompt image\" src=\"{uri}\">" for uri in images
                   if isinstance(uri, str) and DATA_URI.fullmatch(uri))


def prompt_text(prompt: Any) -> str:
    """A plain prompt as it is; a conversation as 'role: content' lines (content parts: their text, [image] for an
    image); anything else as JSON."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt):
        return "\n".join(f"{m.get('role', '?')}: {content_text(m.get('content', ''))}" for m in prompt)
    return json.dumps(prompt, ensure_ascii=False)


def content_text(content: Any) -> str:
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        return "".join(f"[{part.get('type')}]" if part.get("type") != "text" else str(part.get("text", ""))
                       for part in content)
    return str(content)


__all__ = ["ALARM_TITLES", "PLOTS", "ReportError", "load_run", "render", "svg_line_chart", "write_report"]

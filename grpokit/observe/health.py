"""Run-health alarms over the rows of metrics.jsonl: each names the problem, shows the steps and values that
triggered it, and says in one line what to do.

    monitor = HealthMonitor(beta=0.04, reward_weights={"correct": 1.0, "format": 0.5})
    for row in rows:                      # rows as logged (dicts; eval rows included)
        for alarm in monitor.update(row):  # only the alarms that are new at this row, each once per run
            logger.warning("%s", alarm)
    check_run(rows)                       # every alarm of a finished run (the same ones, in firing order)

Every detector is a pure function of a `History` (the finite values of each metric, in logged order) and
`RunInfo` (beta and the reward weights, when known). It reads a bounded window, so `update` costs the same at step
10 and at step 100,000. Missing metrics, None and NaN are skipped: a detector whose metric was never logged stays
silent. Thresholds are the module constants below; docs/report.md lists them with their reasons.
"""

from __future__ import annotations

import bisect
import math
import statistics
from typing import Any, Callable, Iterable, Mapping

# Alarm, History, RunInfo and their helpers live in grpokit/observe/alarms.py; ALARM_TITLES and finite_number (not
# used here) stay importable from this module
from grpokit.observe.alarms import (  # noqa: F401
    ALARM_TITLES,
    Alarm,
    History,
    RunInfo,
    evidence,
    finite_number,
    median,
    recent_mean,
    steps_text,
)

EARLY_ROWS = 5
"""The early level of a metric is the median of its first 5 logged values (one noisy step does not set it)."""
RECENT_ROWS = 3
"""The current level is the median of its last 3 logged values, so one outlier neither fires nor hides an alarm."""

ENTROPY_COLLAPSE_FRACTION = 0.1
"""Entropy collapse: the current entropy is at most 10% of its early level. A healthy run's entropy falls (the
demo's by 5-6x over 100 steps); a 10x fall means most tokens are sampled almost deterministically."""
ENTROPY_FLOOR = 0.005
"""...or it fell below 0.005 nats/token from above: the groups' completions are then nearly identical."""

KL_SPIKE_FACTOR = 10.0
"""KL spike: kl is at least 10x the median of the previous KL_WINDOW logged values. Small-batch KL is noisy (the
demo's healthy run has single-step jumps of up to 8x), so only a jump of an order of magnitude fires..."""
KL_SPIKE_MIN_JUMP = 0.05
"""...and only when kl rose by at least 0.05 nats above that level (near kl = 0, ratios are meaningless)."""
KL_WINDOW = 10
"""The running KL level is the median of the previous 10 logged values, and the first 10 values never fire: kl
starts at 0 (policy = reference) and its ramp-up in the first steps is steep in ratio but not a spike."""

LENGTH_GROWTH_FACTOR = 3.0
"""Length explosion: completions/mean_length is at least 3x its early level."""
LENGTH_SHRINK_FACTOR = 1 / 3
"""Length collapse: completions/mean_length is at most 1/3 of its early level."""
LENGTH_MIN_CHANGE = 8.0
"""...and either way it moved by at least 8 tokens (a 2 -> 7 token change is not an explosion)."""

TRUNCATION_LIMIT = 0.05
"""Truncation: more than 5% of completions end without EOS (completions/clipped_ratio, mean of the last
TRUNCATION_ROWS values). AReaL's guide uses 5%: above it, raise the generation length."""
TRUNCATION_ROWS = 3

TOOL_FAILURE_LIMIT = 0.5
"""Tool failures: more than half of the tool calls failed (tools/failure_frequency, mean of the last
TOOL_FAILURE_ROWS values): the model mostly reads error messages instead of results, so the episodes teach it
little about the task. A grpokit choice (no published threshold); early in training some failures are normal."""
TOOL_FAILURE_ROWS = 3

ZERO_STD_LIMIT = 0.9
"""No learning signal: on average at least 90% of the groups had all-equal rewards (frac_reward_zero_std) over the
last ZERO_STD_ROWS logged steps. Such groups get advantage 0 and no gradient, so 90% means one group in ten
trains. The demo's healthy run, near-solved at the end, peaks at 0.8."""
ZERO_STD_ROWS = 5

DOMINANCE_SHARE = 0.9
"""Reward dominance: one function holds at least 90% of the reward spread, sum over functions of
|weight| * rewards/<name>/std, averaged over the rows of the last DOMINANCE_ROWS where at least two functions
vary. The advantage follows the weighted sum, so the others then barely steer it. A constant function (std 0,
e.g. a saturated format reward) is not counted: it has no spread to be drowned."""
DOMINANCE_ROWS = 5
DOMINANCE_MIN_ROWS = 3
"""...and at least 3 of those rows have two or more varying functions."""

EVAL_FALL_FRACTION = 0.1
"""Train up, eval down: an eval/ metric got worse than its best earlier value by at least 10% of that value (and
at least EVAL_FALL_MIN) while the train reward (mean of the TRAIN_ROWS logged values up to each eval step) rose.
Eval metrics are taken as higher-is-better (rewards, pass@G) except those named in `lower_is_better`."""
EVAL_FALL_MIN = 0.01
TRAIN_ROWS = 5
EVAL_POINTS = 100
"""Only the last 100 evaluations of a metric are compared (bounded work per row)."""

LOSS_KL_TOLERANCE = 0.05
"""Loss is beta*KL: |loss - beta*kl| <= 5% of beta*kl..."""
LOSS_KL_ROWS = 10
"""...at half or more of the last 10 logged steps with kl > 0 (looked for among the last 20). beta is inferred as
the median loss/kl when the monitor was not told it."""


EXPECTED_ALARMS_FILE = "expected_alarms.json"
"""In a run's output_dir: {alarm kind: why this run expects it}, written by whoever knows (the tool demo does);
`grpo report` then shows those alarms as expected, with the reason, instead of as warnings."""


def early_and_recent(h: History, key: str):
    """(early points, recent points) once there are enough values for both windows not to overlap, else None."""
    points = h.get(key)
    if len(points) < EARLY_ROWS + RECENT_ROWS:
        return None
    return points[:EARLY_ROWS], points[-RECENT_ROWS:]


# ---------------------------------------------------------------------------------------------- detectors
def entropy_collapse(h: History, run: RunInfo) -> list[Alarm]:
    """The policy's token entropy fell to a small fraction of its early level, or below an absolute floor: it
    samples almost deterministically, the completions of a group stop differing, and learning stalls."""
    windows = early_and_recent(h, "entropy")
    if windows is None:
        return []
    early, recent = windows
    then, now = median(early), median(recent)
    fell_below_floor = now < ENTROPY_FLOOR <= then
    if not (fell_below_floor or now <= ENTROPY_COLLAPSE_FRACTION * then):
        return []
    share = f"{now / then:.0%} of" if then > 0 else "below"
    return [Alarm(
        "entropy_collapse", recent[-1][0], "entropy",
        f"entropy fell to {now:.3g} nats/token ({steps_text(recent)}), {share} its early level {then:.3g} "
        f"({steps_text(early)}).",
        "Exploration is gone: raise epsilon_high (clip-higher), add entropy_coef or use_adaptive_entropy, raise "
        "temperature, or lower learning_rate.",
        evidence(early, "entropy") + evidence(recent, "entropy"),
    )]


def kl_spike(h: History, run: RunInfo) -> list[Alarm]:
    """kl jumped far above its running level (the median of the previous KL_WINDOW values): one update moved the
    policy much further from the reference than the updates before it, usually an unstable step."""
    points = h.get("kl")
    if len(points) <= KL_WINDOW:
        return []
    previous, (step, value) = points[-KL_WINDOW - 1 : -1], points[-1]
    level = median(previous)
    if value < KL_SPIKE_FACTOR * level or value - level < KL_SPIKE_MIN_JUMP:
        return []
    return [Alarm(
        "kl_spike", step, "kl",
        f"kl jumped to {value:.3g} at step {step}, {value / level if level > 0 else math.inf:.3g}x its running "
        f"level {level:.3g} (median of {steps_text(previous)}).",
        "Look at grad_norm and the clip fractions at that step; lower learning_rate, keep max_grad_norm > 0, or "
        "raise beta.",
        evidence(previous, "kl") + ((step, "kl", value),),
    )]


def completion_length(h: History, run: RunInfo) -> list[Alarm]:
    """The mean completion length drifted far from its early level: an explosion (repetition, rambling, reward
    for length) or a collapse (empty or minimal answers, often a reward hack)."""
    key = "completions/mean_length"
    windows = early_and_recent(h, key)
    if windows is None:
        return []
    early, recent = windows
    then, now = median(early), median(recent)
    if abs(now - then) < LENGTH_MIN_CHANGE:
        return []
    found = evidence(early, key) + evidence(recent, key)
    if now >= LENGTH_GROWTH_FACTOR * then:
        return [Alarm(
            "length_explosion", recent[-1][0], key,
            f"mean completion length grew to {now:.4g} tokens ({steps_text(recent)}), {now / then:.3g}x its early "
            f"level {then:.4g} ({steps_text(early)}).",
            "Unless the rewards ask for longer answers, read completions.jsonl for repetition; add a length penalty "
            "or lower max_completion_length, and watch completions/clipped_ratio.",
            found,
        )]
    if now <= LENGTH_SHRINK_FACTOR * then:
        return [Alarm(
            "length_collapse", recent[-1][0], key,
            f"mean completion length fell to {now:.4g} tokens ({steps_text(recent)}), {now / then:.0%} of its early "
            f"level {then:.4g} ({steps_text(early)}).",
            "Short answers are often a reward hack: read completions.jsonl and check what each reward function gives "
            "an empty or minimal answer.",
            found,
        )]
    return []


def truncation(h: History, run: RunInfo) -> list[Alarm]:
    """More than 5% of completions hit max_completion_length without an EOS (completions/clipped_ratio): their
    rewards judge cut-off answers, and the model learns from them."""
    key = "completions/clipped_ratio"
    window = recent_mean(h.get(key), TRUNCATION_ROWS)
    if window is None or window[1] <= TRUNCATION_LIMIT + 1e-12:  # exactly 5% (summed in floating point) is not above
        return []
    recent, mean = window
    return [Alarm(
        "truncation", recent[-1][0], key,
        f"{mean:.1%} of completions were truncated (no EOS within max_completion_length; mean of "
        f"{steps_text(recent)}), above {TRUNCATION_LIMIT:.0%}.",
        "Raise max_completion_length, or set mask_truncated_completions=True so cut-off answers do not train.",
        evidence(recent, key),
    )]


def tool_failures(h: History, run: RunInfo) -> list[Alarm]:
    """More than half of the tool calls failed (tools/failure_frequency) over the last steps with calls."""
    key = "tools/failure_frequency"
    calls = dict(h.get("tools/call_frequency"))
    window = recent_mean([(s, v) for s, v in h.get(key) if calls.get(s, 0) > 0], TOOL_FAILURE_ROWS)
    if window is None or window[1] <= TOOL_FAILURE_LIMIT:
        return []
    recent, mean = window
    return [Alarm(
        "tool_failures", recent[-1][0], key,
        f"{mean:.0%} of the tool calls failed ({steps_text(recent)}): the model mostly read error messages "
        "instead of results.",
        "Read the tool messages in completions.jsonl: calls written in another format than tool_call_format, "
        "arguments a tool does not take, a tool that raises, or a tool_timeout too short (docs/tools.md).",
        evidence(recent, key),
    )]


def no_learning_signal(h: History, run: RunInfo) -> list[Alarm]:
    """Most groups had all-equal rewards (frac_reward_zero_std) for several steps: their advantages are 0, so
    almost nothing trains. Either every completion succeeds (too easy, or solved) or every one fails (too hard)."""
    key = "frac_reward_zero_std"
    window = recent_mean(h.get(key), ZERO_STD_ROWS)
    if window is None or window[1] < ZERO_STD_LIMIT:
        return []
    recent, mean = window
    reward = h.get("reward")
    level = f" (reward {reward[-1][1]:.3g})" if reward else ""
    return [Alarm(
        "no_learning_signal", recent[-1][0], key,
        f"{mean:.0%} of groups had all-equal rewards over {steps_text(recent)}{level}: their advantages are 0, so "
        "they give no gradient.",
        "Make the prompts harder (all succeed) or easier (all fail), give partial credit, raise num_generations or "
        "temperature, or set dynamic_sampling=True.",
        evidence(recent, key),
    )]


def reward_spreads(h: History, run: RunInfo) -> dict[int, dict[str, float]]:
    """step -> {function name: |weight| * std} over the last DOMINANCE_ROWS steps with per-function stds."""
    by_step: dict[int, dict[str, float]] = {}
    for key, points in h.series.items():
        if key.startswith("rewards/") and key.endswith("/std"):
            name = key[len("rewards/") : -len("/std")]
            for step, value in points[-DOMINANCE_ROWS:]:
                by_step.setdefault(step, {})[name] = abs(run.weight(name)) * value
    return {s: by_step[s] for s in sorted(by_step)[-DOMINANCE_ROWS:]}


def reward_dominance(h: History, run: RunInfo) -> list[Alarm]:
    """One reward function holds nearly all of the weighted reward spread, so the advantages (computed from the
    weighted sum) follow it and the other functions barely steer training. Often a scale mismatch."""
    shares: dict[str, list[float]] = {}
    used = []
    for step, spread in reward_spreads(h, run).items():
        varying = {n: s for n, s in spread.items() if s > 1e-12}
        if len(varying) >= 2:
            used.append(step)
            for name, s in varying.items():
                shares.setdefault(name, []).append(s / sum(varying.values()))
    if len(used) < DOMINANCE_MIN_ROWS:
        return []
    name, values = max(shares.items(), key=lambda item: sum(item[1]))
    share = sum(values) / len(used)
    if share < DOMINANCE_SHARE:
        return []
    key = f"rewards/{name}/std"
    found = tuple((s, k, v) for k, points in h.series.items() if k.startswith("rewards/") and k.endswith("/std")
                  for s, v in points if s in used)
    return [Alarm(
        "reward_dominance", used[-1], key,
        f"reward function {name!r} holds {share:.0%} of the weighted reward spread (|weight| x std) at steps "
        f"{', '.join(map(str, used))}, so the advantages mostly follow it.",
        "If the other functions should matter, rescale them with reward_weights, or set "
        "multi_objective_aggregation='normalize_then_sum' to normalize each before the sum.",
        found,
    )]


def train_mean_up_to(h: History, step: int) -> tuple[float, list[tuple[int, float]]] | None:
    rewards = h.get("reward")
    end = bisect.bisect_right(rewards, step, key=lambda p: p[0])  # steps are logged in order
    points = rewards[max(0, end - TRAIN_ROWS) : end]
    return (sum(v for _, v in points) / len(points), points) if points else None


def train_up_eval_down(h: History, run: RunInfo) -> list[Alarm]:
    """The train reward rose while an eval/ metric got worse than its best value: the policy is overfitting the
    training prompts, or exploiting something in a reward that the evaluation does not share."""
    alarms = []
    for key in sorted(k for k in h.series if k.startswith("eval/")):
        points = h.get(key)[-EVAL_POINTS:]
        if len(points) < 2:
            continue
        sign = -1.0 if key in run.lower_is_better else 1.0
        best, last = max(points[:-1], key=lambda p: sign * p[1]), points[-1]
        train_then, train_now = train_mean_up_to(h, best[0]), train_mean_up_to(h, last[0])
        fall = sign * (best[1] - last[1])
        if train_then is None or train_now is None or fall < max(EVAL_FALL_FRACTION * abs(best[1]), EVAL_FALL_MIN):
            continue
        if train_now[0] <= train_then[0]:
            continue
        alarms.append(Alarm(
            "train_up_eval_down", last[0], key,
            f"{key} {'fell' if sign > 0 else 'rose'} from {best[1]:.4g} (step {best[0]}, its best) to {last[1]:.4g} "
            f"(step {last[0]}) while the train reward rose from {train_then[0]:.4g} to {train_now[0]:.4g}.",
            "Compare completions on eval prompts with train ones; keep the checkpoint of the best eval step, add "
            "training data, or lower learning_rate.",
            evidence([best, last], key) + evidence(train_then[1] + train_now[1], "reward"),
        ))
    return alarms


def loss_is_kl(h: History, run: RunInfo) -> list[Alarm]:
    """The logged loss is ~ beta*kl. Not a problem: on a fresh batch the importance weight is 1 in value and the
    advantages are centred within each group, so the GRPO policy term has zero mean by construction, and the loss
    value says nothing about learning (its gradient does). Watch reward instead."""
    if run.beta == 0:
        return []
    losses = dict(h.get("loss")[-2 * LOSS_KL_ROWS :])
    pairs = [(s, losses[s], k) for s, k in h.get("kl")[-2 * LOSS_KL_ROWS :] if s in losses and k > 0][-LOSS_KL_ROWS:]
    if len(pairs) < LOSS_KL_ROWS:
        return []
    beta = run.beta if run.beta is not None else statistics.median(loss / k for _, loss, k in pairs)
    if beta <= 0:
        return []
    matching = [(s, loss, k) for s, loss, k in pairs if abs(loss - beta * k) <= LOSS_KL_TOLERANCE * beta * k]
    if 2 * len(matching) < len(pairs):
        return []
    source = "" if run.beta is not None else ", inferred as the median loss/kl"
    return [Alarm(
        "loss_is_kl", pairs[-1][0], "loss",
        f"loss = beta*kl within {LOSS_KL_TOLERANCE:.0%} at {len(matching)} of the last {len(pairs)} logged steps "
        f"(beta = {beta:.4g}{source}).",
        "Expected: the GRPO policy term has zero mean by construction (group-centred advantages, importance "
        "weight 1), so the loss says nothing about learning; watch reward and eval (docs/algorithms.md section 5).",
        tuple(e for s, loss, k in matching for e in ((s, "loss", loss), (s, "kl", k))),
        severity="info",
    )]


DETECTORS: tuple[Callable[[History, RunInfo], list[Alarm]], ...] = (
    entropy_collapse, kl_spike, completion_length, truncation, tool_failures, no_learning_signal,
    reward_dominance, train_up_eval_down, loss_is_kl,
)


class HealthMonitor:
    """Feeds logged rows to every detector; `update` returns the alarms that are new at this row.

    beta: the run's beta (None: inferred where needed); reward_weights: function name -> weight (None: all 1);
    lower_is_better: eval metrics ("eval/...") where a smaller value is better (the others: larger is better);
    expected: alarm kind -> why this run expects it (such alarms come as severity "info" with the reason; a demo
    whose policy should become deterministic expects entropy_collapse, say).
    Each alarm (kind, metric) fires once per run: the trainer can log what `update` returns as warnings.
    """

    def __init__(self, beta: float | None = None, reward_weights: Mapping[str, float] | None = None,
                 lower_is_better: Iterable[str] = (), expected: Mapping[str, str] | None = None) -> None:
        weights = dict(reward_weights) if reward_weights is not None else None
        self.run = RunInfo(beta, weights, frozenset(lower_is_better))
        self.expected = dict(expected or {})
        self.history = History()
        self.alarms: list[Alarm] = []
        self._fired: set[tuple[str, str]] = set()

    def update(self, row: Mapping[str, Any]) -> list[Alarm]:
        self.history.add(row)
        new = []
        for detect in DETECTORS:
            for alarm in detect(self.history, self.run):
                if alarm.key not in self._fired:
                    self._fired.add(alarm.key)
                    why = self.expected.get(alarm.kind)
                    new.append(alarm.as_expected(why) if why else alarm)
        self.alarms.extend(new)
        return new


def check_run(rows: Iterable[Mapping[str, Any]], beta: float | None = None,
              reward_weights: Mapping[str, float] | None = None, lower_is_better: Iterable[str] = (),
              expected: Mapping[str, str] | None = None) -> list[Alarm]:
    """Every alarm of a run, in the order they fired, each at the first step it fired (HealthMonitor's arguments)."""
    monitor = HealthMonitor(beta, reward_weights, lower_is_better, expected)
    for row in rows:
        monitor.update(row)
    return monitor.alarms

"""The run-health alarm and what the detectors of grpokit.observe.health read: `Alarm` (one finding, with its
evidence and advice; ALARM_TITLES names each kind), `RunInfo` (beta and the reward weights, when known), `History`
(the finite values of each metric, in logged order) and the small helpers over its (step, value) points.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class Alarm:
    """One run-health finding.

    kind: what (a key of ALARM_TITLES); step: the logged step it fired at; metric: the key it is about;
    message: what happened, with the numbers; advice: one line on what to do; evidence: (step, metric, value)
    triples that triggered it; severity: "warning", or "info" for an explanation that is not a problem;
    expected: why this run expects it (the run's `expected` alarms, e.g. a demo's), "" when it does not.
    """

    kind: str
    step: int
    metric: str
    message: str
    advice: str
    evidence: tuple[tuple[int, str, float], ...] = ()
    severity: str = "warning"
    expected: str = ""

    @property
    def key(self) -> tuple[str, str]:
        """Alarms with the same key fire once per run."""
        return (self.kind, self.metric)

    @property
    def title(self) -> str:
        return ALARM_TITLES.get(self.kind, self.kind)

    def __str__(self) -> str:
        if self.expected:
            return f"[{self.title}, step {self.step}, expected] {self.message} Expected in this run: {self.expected}"
        return f"[{self.title}, step {self.step}] {self.message} {self.advice}"

    def as_expected(self, why: str) -> "Alarm":
        """This alarm as one the run expects: severity info, with the reason."""
        return replace(self, severity="info", expected=why)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "title": self.title}


ALARM_TITLES = {
    "entropy_collapse": "Entropy collapse",
    "kl_spike": "KL spike",
    "length_explosion": "Completion length explosion",
    "length_collapse": "Completion length collapse",
    "truncation": "Truncated completions above 5%",
    "tool_failures": "Most tool calls fail",
    "no_learning_signal": "No learning signal",
    "reward_dominance": "One reward function dominates",
    "train_up_eval_down": "Train reward up, eval down",
    "loss_is_kl": "The loss is only beta*KL",
}


@dataclass(frozen=True)
class RunInfo:
    """What the metrics do not hold: beta (None: unknown), the reward weights by function name (None: 1), and the
    eval metrics where lower is better."""

    beta: float | None = None
    reward_weights: Mapping[str, float] | None = None
    lower_is_better: frozenset[str] = frozenset()

    def weight(self, name: str) -> float:
        return 1.0 if self.reward_weights is None else float(self.reward_weights.get(name, 1.0))


@dataclass
class History:
    """The finite values of every metric, in logged order: series[key] = [(step, value), ...]."""

    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    last_step: int = 0

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]]) -> "History":
        history = cls()
        for row in rows:
            history.add(row)
        return history

    def add(self, row: Mapping[str, Any]) -> None:
        step = row.get("step", self.last_step)
        self.last_step = step if isinstance(step, int) else self.last_step
        for key, value in row.items():
            if key != "step" and finite_number(value):
                self.series.setdefault(key, []).append((self.last_step, float(value)))

    def get(self, key: str) -> list[tuple[int, float]]:
        return self.series.get(key, [])


def finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def median(points: list[tuple[int, float]]) -> float:
    return statistics.median(v for _, v in points)


def evidence(points: list[tuple[int, float]], metric: str) -> tuple[tuple[int, str, float], ...]:
    return tuple((s, metric, v) for s, v in points)


def steps_text(points: list[tuple[int, float]]) -> str:
    first, last = points[0][0], points[-1][0]
    return f"step {first}" if first == last else f"steps {first}-{last}"


def recent_mean(points: list[tuple[int, float]], rows: int) -> tuple[list[tuple[int, float]], float] | None:
    """The last `rows` points and the mean of their values, or None while fewer were logged."""
    recent = points[-rows:]
    if len(recent) < rows:
        return None
    return recent, sum(v for _, v in recent) / len(recent)

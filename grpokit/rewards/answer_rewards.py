"""Rewards that compare the completion's final answer with a gold answer from a dataset column.

The answer is the content of the last <answer>...</answer> in the completion when there is one, else the whole
completion. A sample whose gold answer is missing (None) or unusable scores None: the reward does not apply.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any, Mapping, Sequence

from grpokit.rewards.contract import RESERVED_ARGUMENTS
from grpokit.rewards.text import completion_text, extract_tag

logger = logging.getLogger("grpokit.rewards")
GOLD_COLUMNS = ("solution", "answer")
# A bare gold answer is retried inside $...$ only when it has a mark of mathematics; plain prose stays unparsed.
_MATH_CHARS = re.compile(r"[\d^\\=+\-*/()]")


def final_answer(text: str) -> str:
    """The content of the last <answer> tag, or the whole text (stripped) when there is none."""
    tagged = extract_tag(text, "answer")
    return tagged if tagged is not None else text.strip()


def gold_column(reward: str, columns: Mapping[str, Any], names: Sequence[str]) -> Sequence[Any]:
    """The first of `names` present among the dataset columns; a clear error naming the columns when none is."""
    for name in names:
        if columns.get(name) is not None:
            return columns[name]
    available = sorted(k for k in columns if k not in RESERVED_ARGUMENTS)
    raise ValueError(
        f"{reward} needs a gold-answer column named one of {list(names)}, but the dataset has {available}. "
        f"Rename the column, or pass column=... when building the reward."
    )


def normalize_answer(text: str, case_sensitive: bool) -> str:
    """Collapse whitespace runs to one space, strip, and casefold unless `case_sensitive`."""
    text = " ".join(str(text).split())
    return text if case_sensitive else text.casefold()


class ExactMatchReward:
    """1.0 when the final answer equals the gold answer after normalisation, else 0.0; None without a gold answer.

        r = 1[normalize(final_answer(completion)) == normalize(gold)]

    normalize collapses whitespace and (by default) ignores case. Gold comes from the `answer` column (or the
    column named by `column`).
    """

    def __init__(self, column: str = "answer", case_sensitive: bool = False) -> None:
        self.column, self.case_sensitive = column, case_sensitive
        self.__name__ = "exact_match"

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        golds = gold_column("exact_match", columns, (self.column,))
        out: list[float | None] = []
        for completion, gold in zip(completions, golds):
            if gold is None:
                out.append(None)
                continue
            answer = normalize_answer(final_answer(completion_text(completion)), self.case_sensitive)
            out.append(float(answer == normalize_answer(gold, self.case_sensitive)))
        return out


def _import_math_verify() -> Any:
    try:
        import math_verify
    except ImportError as exc:
        raise ImportError(
            "the math_accuracy reward needs the math-verify package: pip install grpokit[math]"
        ) from exc
    return math_verify


class MathAccuracyReward:
    """1.0 when math-verify finds the completion's answer mathematically equal to the gold answer, else 0.0.

        r = None                                   if the gold answer cannot be parsed
        r = 1[verify(parse(gold), parse(answer))]  otherwise

    Gold comes from the `solution` column, else `answer` (or `column`). The gold is parsed as is, then, if
    that found nothing and it contains a digit or one of ^ \\ = + - * / ( ), wrapped in $...$ (so "x^2+1"
    works); a gold that yields no mathematical object "cannot be parsed". The completion's answer (its last
    <answer> tag, else the whole text) is parsed with math-verify's extraction_mode="first_match".
    math-verify guards parsing with SIGALRM, which only works on the main thread; elsewhere its timeouts are
    off (logged once).
    """

    def __init__(self, column: str | None = None) -> None:
        self._math_verify = _import_math_verify()
        self.columns = (column,) if column else GOLD_COLUMNS
        self.__name__ = "math_accuracy"
        self._warned_thread = False

    def _timeout(self) -> int | None:
        if threading.current_thread() is threading.main_thread():
            return 5
        if not self._warned_thread:
            self._warned_thread = True
            logger.info("math_accuracy runs off the main thread: math-verify parsing timeouts are disabled")
        return None

    def _parse_gold(self, gold: Any, timeout: int | None) -> list:
        """Parsed gold answer, or [] when nothing mathematical (no sympy object, only strings) came out."""
        text = str(gold)
        parsed = self._math_verify.parse(text, parsing_timeout=timeout)
        if not parsed and "$" not in text and _MATH_CHARS.search(text):
            parsed = self._math_verify.parse(f"${text}$", parsing_timeout=timeout)
        return parsed if any(not isinstance(p, str) for p in parsed) else []

    def score(self, text: str, gold: Any) -> float | None:
        timeout = self._timeout()
        parsed_gold = self._parse_gold(gold, timeout) if gold is not None else []
        if not parsed_gold:
            return None
        answer = self._math_verify.parse(final_answer(text), extraction_mode="first_match", parsing_timeout=timeout)
        return float(self._math_verify.verify(parsed_gold, answer, timeout_seconds=timeout))

    def __call__(self, completions: Sequence[Any], **columns: Any) -> list[float | None]:
        golds = gold_column("math_accuracy", columns, self.columns)
        return [self.score(completion_text(c), gold) for c, gold in zip(completions, golds)]

"""Rewards on the surface form of a completion: a required layout, its tags, and n-gram repetition.

Each is a callable class following the reward contract (`grpokit.rewards.contract`); the instance's __name__
is its built-in name, so metrics read rewards/format/mean etc. and the classes also work in TRL unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from grpokit.rewards.text import completion_text

R1_FORMAT = r"<think>.*?</think>\s*<answer>.*?</answer>"
R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


class RegexFormatReward:
    """1.0 when the whole completion (surrounding whitespace stripped) matches `pattern`, else `malformed_reward`.

        r = 1.0                if re.fullmatch(pattern, text.strip(), DOTALL)
        r = malformed_reward   otherwise (0.0 by default; e.g. -1.0 to punish malformed output)

    The default pattern is the DeepSeek-R1 layout `<think>...</think>` then `<answer>...</answer>`, nothing else.
    """

    def __init__(self, pattern: str = R1_FORMAT, malformed_reward: float = 0.0) -> None:
        try:
            self.regex = re.compile(pattern, re.DOTALL)
        except re.error as exc:
            raise ValueError(f"format reward: pattern {pattern!r} is not a valid regular expression: {exc}") from exc
        self.malformed_reward = float(malformed_reward)
        self.__name__ = "format"

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [
            1.0 if self.regex.fullmatch(completion_text(c).strip()) else self.malformed_reward for c in completions
        ]


class TagStructureReward:
    """Partial credit per tag that occurs exactly once, minus a small charge for text after the last tag.

        r = (1/K) * #{k : count(tag_k) == 1}  -  trailing_penalty * T

    with K = len(tags) and T = characters (surrounding whitespace stripped) after the final occurrence of the
    last tag (0 when that tag is missing). Dense where `RegexFormatReward` is all-or-nothing, so it gives a
    gradient while the model is still learning the layout. Defaults: the four R1 tags, trailing_penalty = 0.001.
    """

    def __init__(self, tags: Sequence[str] = R1_TAGS, trailing_penalty: float = 0.001) -> None:
        if not tags:
            raise ValueError("tag_structure reward needs at least one tag, e.g. tags=('<answer>', '</answer>')")
        self.tags = tuple(tags)
        self.trailing_penalty = float(trailing_penalty)
        self.__name__ = "tag_structure"

    def score(self, text: str) -> float:
        present = sum(text.count(tag) == 1 for tag in self.tags)
        last = text.rfind(self.tags[-1])
        trailing = len(text[last + len(self.tags[-1]):].strip()) if last >= 0 else 0
        return present / len(self.tags) - self.trailing_penalty * trailing

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        return [self.score(completion_text(c)) for c in completions]


def repetition_ratio(units: Sequence[Any], n: int) -> float:
    """Share of repeated n-grams: 1 - distinct / total over the len(units) - n + 1 n-grams; 0.0 when there are none."""
    total = len(units) - n + 1
    if total <= 0:
        return 0.0
    distinct = len({tuple(units[i:i + n]) for i in range(total)})
    return 1.0 - distinct / total


class RepetitionPenalty:
    """Negative reward proportional to the share of repeated n-grams.

        r = max_penalty * (1 - distinct_ngrams / total_ngrams)      (0.0 when there are fewer than n units)

    Units are whitespace-separated words (`unit="words"`, default) or the completion's token ids
    (`unit="tokens"`, language-independent). max_penalty <= 0; -1.0 by default; n = 3 by default.
    """

    def __init__(self, n: int = 3, max_penalty: float = -1.0, unit: str = "words") -> None:
        if n < 1:
            raise ValueError(f"repetition_penalty: n must be >= 1, got {n}")
        if max_penalty > 0:
            raise ValueError(f"repetition_penalty: max_penalty must be <= 0 (it is a penalty), got {max_penalty}")
        if unit not in ("words", "tokens"):
            raise ValueError(f"repetition_penalty: unit must be 'words' or 'tokens', got {unit!r}")
        self.n, self.max_penalty, self.unit = n, float(max_penalty), unit
        self.__name__ = "repetition_penalty"

    def __call__(
        self, completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None = None, **kwargs: Any
    ) -> list[float]:
        if self.unit == "tokens":
            if completion_ids is None:
                raise ValueError("repetition_penalty(unit='tokens') needs completion_ids; the trainer passes them")
            units = [list(ids) for ids in completion_ids]
        else:
            units = [completion_text(c).split() for c in completions]
        return [self.max_penalty * repetition_ratio(u, self.n) for u in units]

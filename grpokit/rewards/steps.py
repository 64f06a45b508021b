"""Step rewards (process supervision): splitting a completion into steps, and mapping step ends to tokens.

A process reward function returns, per completion, a list of (end_offset, reward) pairs: end_offset is the
character offset in the completion text where a step ends (exclusive), see grpokit.rewards.contract. The
trainer maps those offsets to token indices with `token_char_ends` and `offsets_to_token_indices`, then turns
the step rewards into per-token advantages with grpokit.algorithms.process.process_advantages.

The completion text is the one the reward functions see: grpokit's trainer decodes the completion ids with
`tokenizer.decode(ids, skip_special_tokens=True)`, so offsets refer to that text (for conversational
completions, to the assistant message's content, which is that same text).
"""

from __future__ import annotations

import bisect
import os
import re
from typing import Any, Callable, Sequence

from grpokit.rewards.contract import RESERVED_ARGUMENTS, reward_name
from grpokit.rewards.text import completion_text

_LINE = re.compile(r"\n")


def _separator(by: str | re.Pattern) -> re.Pattern:
    if isinstance(by, re.Pattern):
        return by
    return _LINE if by == "line" else re.compile(by)


def step_spans(text: str, by: str | re.Pattern = "line") -> list[tuple[int, int, int]]:
    """The non-blank steps of `text` as (start, content_end, end) character offsets.

    The separator matches cut `text` into pieces; piece k runs from the end of separator k - 1 (or 0) to the
    end of separator k, the separator included; the text after the last separator is the last piece. A piece
    whose content (the text before its separator) is empty or whitespace only is blank and skipped.
    text[start:content_end] is the step's content, text[start:end] the whole step.
    """
    spans, start = [], 0
    for match in _separator(by).finditer(text):
        if text[start : match.start()].strip():
            spans.append((start, match.start(), match.end()))
        start = match.end()
    if text[start:].strip():
        spans.append((start, len(text), len(text)))
    return spans


def split_steps(text: str, by: str | re.Pattern = "line") -> list[int]:
    """End offsets (exclusive, strictly increasing, in (0, len(text)]) of the non-blank steps of `text`.

    by="line": each line with non-whitespace content is a step; it ends just after its "\\n", or at len(text)
    for a last line without one. Whitespace-only lines are skipped. Only "\\n" separates lines ("\\r\\n" works,
    the "\\r" stays in the step).
    Any other `by` (a str or a compiled re.Pattern) is a regular expression whose matches separate steps: a
    step ends at the end of its separator match (the separator belongs to the step before it), and the text
    after the last match is a last step ending at len(text) if it is not blank. A step whose text before its
    separator is blank is skipped. (by="line" is the same as by=r"\\n"; to split on the word "line", pass
    re.compile("line").)

    Example: split_steps("a\\n\\nb\\nc") == [2, 5, 6]; split_steps("x=1. y=2. ", r"\\.\\s*") == [5, 10].
    """
    return [end for _, _, end in step_spans(text, by)]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _incremental_ends(tokenizer: Any, ids: list[int], text: str) -> list[int] | None:
    """Character ends from decoding small windows (O(T) work), or None when they do not rebuild `text` exactly.

    Each window starts at the previous chunk of tokens that produced text, so a tokenizer whose decoding depends
    on the token before (SentencePiece's leading space) still gives the right new characters. New characters
    count as far as they agree with `text`: a window ending in the first bytes of a multi-byte character decodes
    to a replacement character, which does not agree, so that token waits until a later one completes it.
    """
    ends, pieces, produced, start, read = [], [], 0, 0, 0
    for t in range(len(ids)):
        context, window = _decode(tokenizer, ids[start:read]), _decode(tokenizer, ids[start : t + 1])
        piece = window[len(context) :] if window.startswith(context) else ""
        agreed = len(os.path.commonprefix([piece, text[produced : produced + len(piece)]]))
        ends.append(max(ends[-1] if ends else 0, produced + agreed))
        if piece and agreed == len(piece):
            pieces.append(piece)
            produced += len(piece)
            start, read = read, t + 1
    return ends if "".join(pieces) == text else None


def _prefix_ends(tokenizer: Any, ids: list[int], text: str) -> list[int]:
    """Character ends from full prefix decodes (O(T^2) work): end[t] = length of the common prefix of
    decode(ids[:t + 1]) and `text`, made non-decreasing."""
    ends, highest = [], 0
    for t in range(len(ids)):
        prefix = _decode(tokenizer, ids[: t + 1])
        agreed = len(prefix) if text.startswith(prefix) else len(os.path.commonprefix([prefix, text]))
        highest = max(highest, agreed)
        ends.append(highest)
    return ends


def token_char_ends(tokenizer: Any, completion_ids: Sequence[int]) -> list[int]:
    """For each token t, how many characters of text = tokenizer.decode(completion_ids, skip_special_tokens=True)
    are complete once tokens 0..t are decoded: the length of the longest prefix of `text` that
    decode(completion_ids[:t + 1]) agrees with, made non-decreasing.

    A token holding the first bytes of a multi-byte character (byte-level BPE, as in Qwen2, GPT-2, Llama 3)
    decodes to a replacement character, so the character is counted at the token that completes it. Special
    tokens (skipped in the decode) produce no characters. Works with any Hugging Face tokenizer: a fast path
    decodes small windows and is checked against `text`; where it does not rebuild `text` exactly, every prefix is
    decoded instead.

    Returns:
        T non-decreasing ints in [0, len(text)]; T = len(completion_ids); the last is len(text) when T > 0.
    """
    ids = [int(i) for i in completion_ids]
    text = _decode(tokenizer, ids)
    ends = _incremental_ends(tokenizer, ids, text)
    return ends if ends is not None else _prefix_ends(tokenizer, ids, text)


def offsets_to_token_indices(char_ends: Sequence[int], offsets: Sequence[int]) -> list[int]:
    """For each character offset, the first token index t with char_ends[t] >= offset: the token that completes
    the character before the offset. An offset past every token's end maps to the last token.

    Args:
        char_ends: T non-decreasing character ends, as from token_char_ends; offsets: any number of offsets.
    Returns:
        one token index in [0, T - 1] per offset.
    """
    if offsets and not char_ends:
        raise ValueError(f"cannot map character offsets {list(offsets)} onto a completion with no tokens")
    last = len(char_ends) - 1
    return [min(bisect.bisect_left(char_ends, offset), last) for offset in offsets]


class StepReward:
    """A process reward function built from a per-step scorer.

    StepReward(score_step, by="line") is a reward function with TRL's signature: for each completion it splits
    the completion text into steps with `step_spans(text, by)` (see split_steps) and calls

        score_step(step_text, prompt, **columns)   # -> float, or None to give that step no reward

    where step_text is the step's content (without its separator), prompt that sample's prompt and columns
    that sample's entry of every dataset column. It returns, per completion, a list of (end_offset, reward)
    pairs, one per scored step (empty when no step was scored). Conversational completions are read with
    grpokit.rewards.text.completion_text. `name` (also `__name__`) is the metric name; by default the scorer's.
    """

    def __init__(
        self,
        score_step: Callable[..., float | None],
        by: str | re.Pattern = "line",
        name: str | None = None,
    ):
        self.score_step = score_step
        self.by = _separator(by)
        self.name = self.__name__ = name or reward_name(score_step)

    def _score(self, completion: Any, prompt: Any, columns: dict[str, Any]) -> list[tuple[int, float]]:
        text = completion_text(completion)
        scored = []
        for start, content_end, end in step_spans(text, self.by):
            reward = self.score_step(text[start:content_end], prompt, **columns)
            if reward is not None:
                scored.append((end, reward))
        return scored

    def __call__(self, prompts: Sequence, completions: Sequence, **kwargs: Any) -> list[list[tuple[int, float]]]:
        columns = {key: value for key, value in kwargs.items() if key not in RESERVED_ARGUMENTS}
        return [
            self._score(completion, prompts[i], {key: value[i] for key, value in columns.items()})
            for i, completion in enumerate(completions)
        ]

"""Rewards on completion length, measured in tokens: len(completion_ids[i]), the ids without padding.

Both need the generation limit (the trainer's max_completion_length), because "too long" only means something
relative to it; `resolve_reward_funcs(..., max_completion_length=...)` fills it in for the built-in names.
"""

from __future__ import annotations

from typing import Any, Sequence


def _check_limit(who: str, max_completion_length: int) -> int:
    if not isinstance(max_completion_length, int) or max_completion_length < 1:
        raise ValueError(
            f"{who}: max_completion_length must be a positive int (the generation limit in tokens), "
            f"got {max_completion_length!r}"
        )
    return max_completion_length


def soft_overlong_punishment(length: int, max_completion_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment for one completion of `length` tokens.

    From "DAPO" (Yu et al. 2025, arXiv:2503.14476), overlong reward shaping; L = length, L_max =
    max_completion_length, L_cache = cache_length:

        r = 0                                   if L <= L_max - L_cache
        r = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max      (falls linearly 0 -> -1)
        r = -1                                  if L > L_max
    """
    expected = max_completion_length - cache_length
    if length <= expected:
        return 0.0
    if length <= max_completion_length:
        return (expected - length) / cache_length
    return -1.0


class SoftOverlongPunishment:
    """DAPO's length-aware penalty: free up to L_max - L_cache tokens, then linearly down to -1 at L_max.

    See `soft_overlong_punishment` for the formula. L_max = max_completion_length; L_cache = cache_length,
    by default a fifth of L_max (DAPO used L_max = 20480 with L_cache = 4096).
    """

    def __init__(self, max_completion_length: int, cache_length: int | None = None) -> None:
        self.max_completion_length = _check_limit("soft_overlong", max_completion_length)
        self.cache_length = cache_length if cache_length is not None else max(1, max_completion_length // 5)
        if not 0 < self.cache_length <= self.max_completion_length:
            raise ValueError(
                f"soft_overlong: cache_length must be in [1, max_completion_length={max_completion_length}], "
                f"got {self.cache_length}"
            )
        self.__name__ = "soft_overlong"

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        return [
            soft_overlong_punishment(len(ids), self.max_completion_length, self.cache_length) for ids in completion_ids
        ]


class LengthPenalty:
    """Linear penalty for tokens beyond a target length, reaching -coef at the generation limit.

        r = -coef * clip((L - target_length) / (max_completion_length - target_length), 0, 1)

    With target_length = 0 (default) every token costs coef / max_completion_length: a plain push to brevity.
    """

    def __init__(self, max_completion_length: int, target_length: int = 0, coef: float = 1.0) -> None:
        self.max_completion_length = _check_limit("length_penalty", max_completion_length)
        if not 0 <= target_length < max_completion_length:
            raise ValueError(
                f"length_penalty: target_length must be in [0, max_completion_length={max_completion_length}), "
                f"got {target_length}"
            )
        if coef < 0:
            raise ValueError(f"length_penalty: coef must be >= 0 (the reward is -coef at the limit), got {coef}")
        self.target_length, self.coef = target_length, float(coef)
        self.__name__ = "length_penalty"

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        span = self.max_completion_length - self.target_length
        return [-self.coef * min(max((len(ids) - self.target_length) / span, 0.0), 1.0) for ids in completion_ids]

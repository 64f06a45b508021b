"""reasoning-gym entries (and task configs) as JSON strings, for the rg_entry and rg_config dataset columns.

    encode_entry({"answer": (1, 2), "metadata": {3: {"a"}}})  ->  JSON text
    decode_entry(text)                                         ->  the same value: tuples, sets and dicts with
                                                                   non-string keys come back as they went in

reasoning-gym's scorers compare entries with ==, so the round trip keeps the types JSON has no form for.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

_TAG = "__rg_type__"


def encode_entry(value: Any) -> str:
    """A reasoning-gym entry (or config) as JSON that decode_entry turns back into equal values of the same types:
    tuples, sets and dicts with non-string keys are tagged, since scorers compare them with ==."""

    def tagged(obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [tagged(v) for v in obj]
        if isinstance(obj, tuple):
            return {_TAG: "tuple", "items": [tagged(v) for v in obj]}
        if isinstance(obj, (set, frozenset)):
            return {_TAG: type(obj).__name__, "items": [tagged(v) for v in obj]}
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj) and _TAG not in obj:
                return {k: tagged(v) for k, v in obj.items()}
            return {_TAG: "dict", "items": [[tagged(k), tagged(v)] for k, v in obj.items()]}
        if hasattr(obj, "item") and callable(obj.item):  # a numpy scalar
            return tagged(obj.item())
        raise TypeError(f"cannot store a {type(obj).__name__} ({obj!r:.80}) in a dataset column")

    return json.dumps(tagged(value))


def decode_entry(text: str) -> Any:
    """The value encode_entry wrote."""

    def untag(obj: Any) -> Any:
        if isinstance(obj, list):
            return [untag(v) for v in obj]
        if isinstance(obj, dict):
            kind = obj.get(_TAG)
            if kind is None:
                return {k: untag(v) for k, v in obj.items()}
            items = [untag(v) for v in obj["items"]]
            if kind == "dict":
                return {_hashable(k): v for k, v in items}
            return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](items)
        return obj

    return untag(json.loads(text))


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key

"""Turn reward specs (callables, names, import paths, URLs, model paths, dicts) into named RewardFunctions.

Everything here runs before training starts, so a typo fails in the first second, not after the model loads.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from typing import Any, Callable, Mapping, Sequence

from grpokit.imports import ImportPathError, import_path, is_import_path

from grpokit.rewards.answer_rewards import ExactMatchReward, MathAccuracyReward
from grpokit.rewards.code_reward import CodeExecutionReward
from grpokit.rewards.contract import RewardError, RewardFunction, reward_name, unique_names
from grpokit.rewards.format_rewards import RegexFormatReward, RepetitionPenalty, TagStructureReward
from grpokit.rewards.http_reward import HTTPRewardFunction
from grpokit.rewards.length_rewards import LengthPenalty, SoftOverlongPunishment
from grpokit.rewards.reward_model import RewardModelFunction
from grpokit.tasks.reasoning_gym import ReasoningGymReward

BUILTIN_REWARDS: dict[str, Callable[..., Callable]] = {
    "format": RegexFormatReward,
    "tag_structure": TagStructureReward,
    "math_accuracy": MathAccuracyReward,
    "exact_match": ExactMatchReward,
    "length_penalty": LengthPenalty,
    "soft_overlong": SoftOverlongPunishment,
    "repetition_penalty": RepetitionPenalty,
    "code_execution": CodeExecutionReward,
    "reasoning_gym": ReasoningGymReward,  # reasoning-gym's own scorers (grpokit[tasks]; docs/tasks.md)
}
# open-r1's names for the same rewards (a recipe's reward_funcs: [accuracy, format, tag_count] runs unchanged)
REWARD_ALIASES = {"accuracy": "math_accuracy", "tag_count": "tag_structure"}

ACCEPTED_FORMS = (
    "a callable (function, async function or callable object); "
    f"a built-in name ({', '.join(BUILTIN_REWARDS)}); "
    "an import path 'package.module:function'; "
    "an http:// or https:// URL of a reward service; "
    "a local folder or hub name ('org/name') of an AutoModelForSequenceClassification reward model, or such a "
    "model object; "
    "or a dict {'name': <built-in name or import path>, **options}"
)
_HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")


def _unknown(spec: str) -> RewardError:
    close = difflib.get_close_matches(spec, list(BUILTIN_REWARDS), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return RewardError(f"unknown reward {spec!r}.{hint} A reward spec is {ACCEPTED_FORMS}.")


def build_builtin(name: str, options: Mapping[str, Any], max_completion_length: int | None) -> Callable:
    """Instantiate the built-in `name` (or its alias) with `options`, filling max_completion_length when it takes
    one."""
    name = REWARD_ALIASES.get(name, name)
    factory = BUILTIN_REWARDS[name]
    params = inspect.signature(factory).parameters
    options = dict(options)
    unknown = sorted(set(options) - set(params))
    if unknown:
        raise RewardError(f"built-in reward {name!r} has no option(s) {unknown}; its options are {sorted(params)}")
    if "max_completion_length" in params and "max_completion_length" not in options:
        if max_completion_length is None:
            raise RewardError(
                f"built-in reward {name!r} needs the generation limit: pass "
                f"{{'name': {name!r}, 'max_completion_length': <tokens>}} or "
                f"resolve_reward_funcs(..., max_completion_length=<tokens>)"
            )
        options["max_completion_length"] = max_completion_length
    try:
        return factory(**options)
    except (TypeError, ValueError, ImportError) as exc:
        raise RewardError(f"could not build built-in reward {name!r} with {options}: {exc}") from exc


def import_reward(path: str, options: Mapping[str, Any] | None = None) -> Callable:
    """Load 'package.module:attr' (attr may be dotted). A class is instantiated with `options`; a callable is
    returned as is (options then must be empty)."""
    try:
        obj = import_path(path, "reward_funcs")
    except ImportPathError as exc:
        raise RewardError(str(exc)) from exc
    if inspect.isclass(obj):
        try:
            return obj(**dict(options or {}))
        except TypeError as exc:
            raise RewardError(f"reward import path {path!r}: could not instantiate the class: {exc}") from exc
    if not callable(obj):
        raise RewardError(f"reward import path {path!r} names a {type(obj).__name__}, not a callable")
    if options:
        raise RewardError(f"reward import path {path!r} is a function; options {dict(options)} apply only to classes")
    return obj


def _is_model_object(spec: Any) -> bool:
    """A transformers model object (a reward model given as an object, TRL's form), not a callable to call."""
    from transformers import PreTrainedModel

    return isinstance(spec, PreTrainedModel)


def resolve_reward(spec: Any, reward_model_kwargs: Mapping[str, Any], max_completion_length: int | None) -> Callable:
    """One spec -> one callable (see ACCEPTED_FORMS)."""
    if _is_model_object(spec):
        return RewardModelFunction(spec, **dict(reward_model_kwargs))
    if isinstance(spec, RewardFunction) or (callable(spec) and not isinstance(spec, (str, Mapping))):
        return spec
    if isinstance(spec, Mapping):
        options = dict(spec)
        name = options.pop("name", None)
        if not isinstance(name, str):
            raise RewardError(f"dict reward spec {dict(spec)} needs a 'name' (a built-in name or import path)")
        if name in BUILTIN_REWARDS or name in REWARD_ALIASES:
            return build_builtin(name, options, max_completion_length)
        if is_import_path(name):
            return import_reward(name, options)
        raise _unknown(name)
    if not isinstance(spec, str):
        raise RewardError(f"reward spec {spec!r} of type {type(spec).__name__} is not accepted; it is {ACCEPTED_FORMS}")
    if spec.startswith(("http://", "https://")):
        try:
            return HTTPRewardFunction(spec)
        except ValueError as exc:
            raise RewardError(str(exc)) from exc
    if spec in BUILTIN_REWARDS or spec in REWARD_ALIASES:
        return build_builtin(spec, {}, max_completion_length)
    if is_import_path(spec):
        return import_reward(spec)
    if os.path.isdir(spec) or _HUB_NAME.match(spec):
        try:
            return RewardModelFunction(spec, **dict(reward_model_kwargs))
        except (OSError, ValueError, TypeError) as exc:
            raise RewardError(
                f"could not load reward model {spec!r}: {exc}. A reward model is a local folder or hub name of an "
                "AutoModelForSequenceClassification with its tokenizer."
            ) from exc
    raise _unknown(spec)


def resolve_reward_funcs(
    specs: Sequence[Any],
    reward_model_kwargs: Mapping[str, Any] | None = None,
    max_completion_length: int | None = None,
    processing_classes: Any = None,
) -> list[RewardFunction]:
    """Resolve every spec into a RewardFunction with a unique metric name; fail early with a clear message.

    reward_model_kwargs go to every RewardModelFunction (e.g. device, dtype, batch_size, max_length);
    max_completion_length fills the generation limit of the length-based built-ins when their spec omits it.
    processing_classes (TRL's reward_processing_classes): one tokenizer (or None) per spec, or one tokenizer for a
    single spec; a reward model uses its entry instead of loading its own, other kinds of function ignore it.
    Names: function __name__, class name, the built-in name, URL host or model folder name; repeats get _2, _3.
    """
    if isinstance(specs, (str, Mapping)) or callable(specs):
        specs = [specs]
    if not specs:
        raise RewardError(f"no reward functions given; pass at least one: {ACCEPTED_FORMS}")
    classes = per_spec(processing_classes, len(specs))
    base = dict(reward_model_kwargs or {})
    funcs = [
        resolve_reward(spec, base if tok is None else {**base, "tokenizer": tok}, max_completion_length)
        for spec, tok in zip(specs, classes)
    ]
    names = unique_names([reward_name(f) for f in funcs])
    return [RewardFunction(f.fn if isinstance(f, RewardFunction) else f, name) for f, name in zip(funcs, names)]


def per_spec(processing_classes: Any, count: int) -> list[Any]:
    """reward_processing_classes as one entry per reward function (None where not given)."""
    if processing_classes is None:
        return [None] * count
    classes = list(processing_classes) if isinstance(processing_classes, (list, tuple)) else [processing_classes]
    if len(classes) != count:
        raise ValueError(
            f"reward_processing_classes has {len(classes)} entries but there are {count} reward functions; the counts "
            "must match: give one per reward function, in order (None for a function that is not a reward model)."
        )
    return classes

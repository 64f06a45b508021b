"""The rollout-engine boundary: the only way the trainer gets completions.

    request = RolloutRequest(prompt_ids, sample_ids, params, seed, return_logprobs)
    rollout = engine.generate(request)        # completion ids, masks, truncation, sampler log-probs
    engine.sync_weights(weights, version)     # a weight stream, after optimizer steps changed the weights

Everything that crosses the boundary is plain data (token-id lists, CPU tensors, numbers), so an engine can live
in another process or on another machine. The trainer counts weight versions (one per optimizer step that changed
the weights) and syncs lazily, right before a generation that needs newer weights; a `Rollout` says which version
produced it. The asynchronous pipeline (grpokit/train/asynchronous.py) relies on it: a batch made by older weights
gets old log-probs in the learner's prepare, and the lag is corrected with the sampler's log-probs (the mismatch
weights of grpokit.algorithms.mismatch).

`ROLLOUT_ENGINES` (a grpokit.registry.Registry) is the only list of engines. Built in: "local"
(grpokit.rollout.local, the in-process decode loop) and "vllm" (grpokit.rollout.vllm_engine, colocate or server).
A user adds one from their own code:

    @register_rollout_engine("mine", check_options=my_checks)   # check_options is optional
    def make(context: EngineContext) -> RolloutEngine: ...

and selects it with `rollout_engine="mine"` (or an import path "pkg.module:make"). `check_options(config)` returns
a list of problems with the engine's own options (each message says how to fix it); GRPOConfig runs it when the
engine is chosen by name, so a bad value fails before any model loads.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from grpokit.registry import Registry


class RolloutEngineError(RuntimeError):
    """The rollout engine cannot generate (not installed, not reachable, died); the message says what to do."""


@dataclass
class SamplingParams:
    """Plain numbers for the rollout; the trainer fills them from GRPOConfig."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict | None = None


@dataclass
class RolloutRequest:
    """One batch to generate: N entries, one completion each (the caller repeats each prompt G times).

    prompt_ids: N token lists. sample_ids: (N,) int64 global completion ids; an engine that can (the local one;
    vLLM through per-request seeds) derives each completion's randomness from (seed, sample id) alone.
    return_logprobs: also return the sampler's log-probs of the drawn tokens.
    lockstep: every process must run as many forwards of the policy as the others (its forwards are collectives:
    a sharded policy not gathered for generation); an engine decoding in-process keeps going until every process
    is done. Engines with weights of their own ignore it.
    vision: None for text prompts, else N entries, each the prompt's images (grpokit.vision.PromptVision: the
    processor's tensors, the PIL images) or None for an entry without; the prompt ids already hold each image's
    tokens, expanded once.
    """

    prompt_ids: list[list[int]]
    sample_ids: torch.Tensor
    params: SamplingParams
    seed: int
    return_logprobs: bool = False
    lockstep: bool = False
    vision: list | None = None


@dataclass
class Rollout:
    """Completions of one batch, right-padded, on the CPU.

    completion_ids: (N, T) token ids, pad after the end; completion_mask: (N, T) 1 up to and including the first
    EOS; truncated: (N,) bool, True where no EOS came within max_completion_length; logprobs: (N, T) float32 log
    p_sampler of each drawn token under the sampler's processed distribution (after temperature, top-k, top-p,
    min-p), 0 where the mask is 0, or None when not requested; weights_version: the trainer's weight version the
    engine generated with (None: the engine reads the live model, so it is always current).
    tool_mask: None for single-turn rollouts; for multi-turn ones (grpokit.rollout.multiturn), (N, T) 1 where the
    model wrote the token and 0 where a tool or environment did. Then completion_mask covers the whole transcript
    (it may hold several EOS tokens, one per model turn) and the loss counts completion_mask * tool_mask.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    logprobs: torch.Tensor | None = None
    weights_version: int | None = None
    tool_mask: torch.Tensor | None = None

    @property
    def model_mask(self) -> torch.Tensor:
        """(N, T) 1 on the tokens the model wrote: completion_mask, times tool_mask for multi-turn rollouts."""
        return self.completion_mask if self.tool_mask is None else self.completion_mask * self.tool_mask


@runtime_checkable
class Weights(Protocol):
    """A stream of the policy's weights (grpokit.train.weights.WeightStream): every weight whole, under its Hugging
    Face name, a PEFT adapter merged in, a tied weight under each of its names. `collective`: reading it gathers
    shards (FSDP2), so every process reads it to its end, in step; a fresh stream is given for every push."""

    collective: bool

    def specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """Every (name, shape, dtype), in the stream's order, without gathering anything."""

    def __iter__(self):
        """(name, tensor) pairs."""


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator.

    Optional attributes the trainer reads: `version`, the weight version the engine starts with (0, the default:
    built from the policy's current weights; None: push before the first generation); `shared_across_processes =
    True` (one engine serves every training process, like a server): then only process 0 calls sync_weights, and
    the others wait for it (a collective weight stream, under FSDP2: every process calls it, and the engine lets
    process 0 write); `responsive() -> bool`, for an engine in another process: whether it is alive (asked by
    the asynchronous producer's heartbeat when a call to it has blocked for heartbeat_stale_after_s; without it, a
    call that long is taken for a hang).
    """

    name: str

    def generate(self, request: RolloutRequest) -> Rollout:
        """Sample one completion per entry of the request."""

    def sync_weights(self, weights: "Weights", version: int) -> None:
        """Generate with these weights from now on (version: the trainer's count). An engine that reads the live
        policy (the local one) has nothing to do."""

    def close(self) -> None:
        """Release the engine's resources (memory, processes, connections); safe to call twice."""


@dataclass
class EngineContext:
    """What an engine factory gets: the live policy, its tokenizer and the run's options.

    model: the unwrapped policy (a PeftModel when training adapters); eos_token_ids / pad_token_id: the ids the
    rollout stops at and pads with; max_model_length: longest prompt + max_completion_length; autocast: a
    context-manager factory for the run's precision; options: the GRPOConfig (engines read their own options
    from it, e.g. the vllm_* ones). weights: a factory of fresh `Weights` streams of the policy (an engine with
    its own copy starts from one; under FSDP reading it is a collective). sharded: the policy's parameters are
    shards (FSDP2), so a decode step that reads the weights directly cannot run on them.
    """

    model: torch.nn.Module
    tokenizer: Any
    eos_token_ids: list[int]
    pad_token_id: int
    max_model_length: int
    options: Any
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    extra: dict[str, Any] = field(default_factory=dict)
    weights: Callable[[], Weights] | None = None
    sharded: bool = False


EngineFactory = Callable[[EngineContext], RolloutEngine]
OptionCheck = Callable[[Any], list[str]]


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: its factory, and optionally check_options(config) -> problems with its own options."""

    factory: EngineFactory
    name: str
    check_options: OptionCheck | None = None

    def __call__(self, context: EngineContext) -> RolloutEngine:
        return self.factory(context)


ROLLOUT_ENGINES = Registry("rollout_engine", EngineEntry, expected="a factory f(EngineContext) -> engine")


def register_rollout_engine(name: str, check_options: OptionCheck | None = None) -> Callable[[EngineFactory], EngineFactory]:
    """Decorator: add a factory `f(EngineContext) -> RolloutEngine` to ROLLOUT_ENGINES under `name`, with the
    engine's own option checks (`check_options(config) -> list of problems`, optional)."""
    return ROLLOUT_ENGINES.register(name, check_options=check_options)


def _load_builtin_engines() -> None:
    import grpokit.rollout.local  # noqa: F401  (registers "local")
    import grpokit.rollout.vllm_engine  # noqa: F401  (registers "vllm"; imports vllm only when used)


def engine_names() -> list[str]:
    _load_builtin_engines()
    return ROLLOUT_ENGINES.names()


def resolve_engine(spec: str) -> EngineFactory:
    """A registered name or an import path "pkg.module:factory" -> the factory; ValueError listing the engines."""
    _load_builtin_engines()
    return ROLLOUT_ENGINES.resolve(spec).factory


def engine_option_problems(spec: str, options: Any) -> list[str]:
    """The chosen engine's own checks of `options` (a GRPOConfig); [] for an engine without checks. An import path
    is not imported here: the trainer resolves it when it starts (the module may exist only there)."""
    if ":" in spec:
        return []
    _load_builtin_engines()
    check = ROLLOUT_ENGINES.resolve(spec).check_options
    return [] if check is None else list(check(options))


def mask_after_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) ids -> (N, T) mask keeping tokens up to and including the first EOS, and (N,) truncated flags."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(-1), torch.full_like(has_eos, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(-1)).long()
    return mask, ~has_eos


def pad_rollout(
    token_lists: list[list[int]],
    logprob_lists: list[list[float]] | None,
    eos_ids: list[int],
    pad_id: int,
    weights_version: int | None = None,
    tool_masks: list[list[int]] | None = None,
    truncated: list[bool] | None = None,
) -> Rollout:
    """Per-completion token lists (as an external engine returns them) -> a right-padded Rollout.

    The mask and truncation flags follow the local engine's rule: tokens up to and including the first EOS count;
    a completion without EOS is truncated. Anything after the first EOS is replaced by pad. Multi-turn transcripts
    (`tool_masks` and `truncated` given) keep every token: their EOS tokens end turns, not the completion.
    """
    width = max(1, max(len(t) for t in token_lists))
    ids = torch.full((len(token_lists), width), -1, dtype=torch.long)  # -1: never an EOS id, unlike pad_id can be
    logprobs = torch.zeros((len(token_lists), width), dtype=torch.float32) if logprob_lists is not None else None
    tool_mask = torch.zeros((len(token_lists), width), dtype=torch.long) if tool_masks is not None else None
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        if logprobs is not None:
            logprobs[row, : len(tokens)] = torch.tensor(logprob_lists[row], dtype=torch.float32)
        if tool_mask is not None:
            tool_mask[row, : len(tokens)] = torch.tensor(tool_masks[row], dtype=torch.long)
    present = (ids >= 0).long()  # not past a completion's own end
    if tool_masks is None:
        mask, truncated = mask_after_eos(ids, eos_ids)
        mask = mask * present
    else:
        mask, truncated = present, torch.tensor(truncated, dtype=torch.bool)
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
    if logprobs is not None:
        logprobs = logprobs * mask
    return Rollout(ids, mask, truncated, logprobs, weights_version, tool_mask)

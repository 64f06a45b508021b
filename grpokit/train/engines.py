"""The collector's side of the rollout engine: building it (`make_engine`), the weight version it holds
(`Pushed`), whether another program or older weights sample (`samples_elsewhere`, `wants_sampler_logprobs`), and
the rollouts of several engine calls joined into one (`join_rollouts`). Used by grpokit.train.collector, which
keeps these names importable."""

from __future__ import annotations

import atexit

from grpokit.config import ConfigError
from grpokit.rollout.engine import EngineContext, Rollout, pad_rollout, resolve_engine
from grpokit.train.setup import Setup


class Pushed:
    """The weight version an engine holds, shared by the collectors that push into the same engine (the loop's and
    the asynchronous producer's)."""

    def __init__(self, version: int | None) -> None:
        self.version = version


def samples_elsewhere(args) -> bool:
    """The sampler is not the policy being trained: another program (any engine but "local"), or older weights
    (asynchronous rollouts, max_staleness > 0)."""
    return args.resolved_rollout_engine != "local" or args.max_staleness > 0


def wants_sampler_logprobs(args, engine: str) -> bool:
    """The sampler's log-probs are compared with the trainer's only where another program or older weights sample:
    for the mismatch correction, or for the off-policy mask."""
    elsewhere = engine != "local" or args.max_staleness > 0
    return elsewhere and (args.vllm_importance_sampling_correction or args.off_policy_mask_threshold is not None)


def join_rollouts(parts: list[Rollout], eos_ids: list[int], pad_id: int) -> Rollout:
    """Rollouts of consecutive rows (engine calls of max_inflight_tasks completions) as one, padded to the widest."""
    tokens, logprobs, tool_masks, truncated = [], [], [], []
    for part in parts:
        mask = part.completion_mask.bool()
        for i in range(part.completion_ids.shape[0]):
            tokens.append(part.completion_ids[i][mask[i]].tolist())
            logprobs.append(None if part.logprobs is None else part.logprobs[i][mask[i]].tolist())
            tool_masks.append(None if part.tool_mask is None else part.tool_mask[i][mask[i]].tolist())
            truncated.append(bool(part.truncated[i]))
    return pad_rollout(tokens, None if parts[0].logprobs is None else logprobs, eos_ids, pad_id,
                       parts[0].weights_version, tool_masks=None if parts[0].tool_mask is None else tool_masks,
                       truncated=truncated)


def make_engine(setup: Setup, model, autocast, eos_ids: list[int], weights, sharded: bool = False):
    """The rollout engine named by rollout_engine / use_vllm, built from the live (unwrapped) policy and a factory
    of its weight streams (`sharded`: its parameters are FSDP2 shards), and the longest sequence it must hold
    (longest prompt + max_completion_length)."""
    args = setup.args
    try:
        factory = resolve_engine(args.resolved_rollout_engine)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    prompts = setup.prompt_ids + [p for ids in setup.eval_prompt_ids.values() for p in ids]
    longest = max(map(len, prompts))
    if setup.agent.environments is not None and args.max_prompt_length:  # reset() may lengthen prompts up to this
        longest = max(longest, args.max_prompt_length)
    max_model_length = longest + args.max_completion_length
    context = EngineContext(
        model=model, tokenizer=setup.tokenizer, eos_token_ids=eos_ids, pad_token_id=setup.tokenizer.pad_token_id,
        max_model_length=max_model_length, options=args, autocast=autocast, weights=weights, sharded=sharded,
        extra={"max_concurrent_sequences": args.per_device_train_batch_size
               * setup.geometry.micro_batches_per_generation},
    )
    engine = factory(context)
    atexit.register(engine.close)
    return engine, max_model_length

"""The local engine's decode loop: prompts in, one sampled completion per entry out, masked after EOS.

GRPO samples G completions of each prompt, and the trainer repeats each prompt G times. `generate_completions`
runs each *distinct* prompt through the model once (prefill), copies its KV cache to its G rows, then decodes
all rows together in a plain loop; no `transformers.generate` machinery per token, and only the last position's
logits are ever computed. The token drawn for completion c at position t is an inverse-CDF draw from the processed
distribution with a uniform number hashed from (seed, c, t) (see sampling.py), so a completion does not depend on
which other rows share the batch. Options the loop does not implement (any generation_kwargs key other than
min_new_tokens) fall back to `transformers.generate` with the same sampler as its last logits processor.

A model sharded with FSDP2 decodes through its own FSDP hooks: each forward gathers one layer's full weights at a
time and frees them after it (never a second full copy of the model per process), every decode step included.
Those gathers are collectives, so every process must make the same forward calls: the loop stops only when every
process's completions have ended (one all-reduce of a flag per step), a process whose rows ended decodes padding
until then, transformers.generate runs with synced_gpus, and the gathered root is freed at the end. Inside
`gathered_for_generation` (grpokit/train/fsdp.py: every unit already gathered) forwards make no collective, so
none of that applies: each process decodes on its own and the weights stay gathered for the next call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpokit.models.kv_cache import cache_kwargs
from grpokit.rollout.engine import Rollout, SamplingParams, mask_after_eos
from grpokit.rollout.lean_decode import LeanDecoder
from grpokit.rollout.lean_decode import supports as supports_lean_decode
from grpokit.rollout.sampling import CounterSampler
from grpokit.vision.model_inputs import forward_inputs, is_mrope, placeholder_ids, rope_positions


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: (N, L) ids and (N, L) attention mask."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


# generation_kwargs keys the decode loop implements itself; any other key falls back to transformers.generate.
DECODE_LOOP_KWARGS = frozenset({"min_new_tokens", "do_sample"})  # do_sample: always True (the config checks)


def _processors(params: SamplingParams, sampler: CounterSampler | None, penalties: bool = False) -> LogitsProcessorList:
    """The logits processors for params, then `sampler` (when given) as the last one."""
    chain = []
    if penalties and params.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p is not None:
        chain.append(MinPLogitsWarper(params.min_p))
    if sampler is not None:
        chain.append(sampler)
    return LogitsProcessorList(chain)


def eos_token_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    sample_ids: torch.Tensor,
    params: SamplingParams,
    seed: int,
    return_logprobs: bool = False,
    lockstep: bool = False,
    sharded: bool = False,
    vision: list | None = None,
) -> Rollout:
    """Sample one completion per entry of prompt_ids (the caller repeats each prompt G times).

    Args:
        prompt_ids: N token lists; sample_ids: (N,) global completion ids, which fix each completion's noise.
        lockstep: the model's forwards are collectives (a sharded model, not gathered): every process decodes
            until every process's rows have ended. sharded: its parameters are shards (no lean decode step).
        return_logprobs: also return (N, T) log-probs of the drawn tokens under the processed distribution.
        vision: N entries of prompt images (grpokit.vision.PromptVision or None), or None: text prompts.
    """
    eos = eos_token_ids(model, tokenizer)
    was_training = model.training
    model.eval()
    try:
        decode = _decode_shared_prompts if set(params.generation_kwargs or {}) <= DECODE_LOOP_KWARGS else _hf_generate
        device = next(model.parameters()).device
        sampler = CounterSampler(seed, sample_ids.to(device), 0, record_logprobs=return_logprobs)
        prompts = Prompts(prompt_ids, vision if vision is not None and any(v is not None for v in vision) else None)
        completion = decode(model, prompts, sampler, params, tokenizer.pad_token_id, eos, lockstep, sharded)
    finally:
        model.train(was_training)
    mask, truncated = mask_after_eos(completion, eos)
    completion = torch.where(mask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    logprobs = None
    if return_logprobs:
        logprobs = torch.stack(sampler.logprobs, 1)[:, : completion.shape[1]].cpu() * mask.cpu()  # (N, T)
    return Rollout(completion.cpu(), mask.cpu(), truncated.cpu(), logprobs)


@dataclass(frozen=True)
class Prompts:
    """N prompts to complete: token lists and, for prompts with images, N PromptVision-or-None entries."""

    ids: list[list[int]]
    vision: list | None = None

    def keys(self) -> list[tuple]:
        """A key per entry: equal keys, equal prompts (ids and images)."""
        visions = self.vision or [None] * len(self.ids)
        return [(tuple(p), None if v is None else v.key) for p, v in zip(self.ids, visions)]


def _prefill(model, prompts: Prompts, pad_id: int, cache, device):
    """One forward over each distinct prompt (its images encoded here, once): (N,) distinct row of each entry,
    (U, P) ids and mask, (U, P) text positions, (U, 1, V) logits, (U,) position offset of each prompt (multimodal
    RoPE's delta; 0 otherwise)."""
    keys = prompts.keys()
    distinct = list(dict.fromkeys(keys))
    row_of = {k: i for i, k in enumerate(distinct)}
    first_of: dict = {}
    for i, k in enumerate(keys):
        first_of.setdefault(k, i)
    first = [first_of[k] for k in distinct]
    expand = torch.tensor([row_of[k] for k in keys], device=device)  # (N,) distinct row of each
    ids, attention = left_pad([list(prompts.ids[i]) for i in first], pad_id)
    ids, attention = ids.to(device), attention.to(device)
    padded = bool((attention == 0).any())
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # (U, P)
    visions = None if prompts.vision is None else [prompts.vision[i] for i in first]
    rope = rope_positions(model, visions, ids, attention) if visions is not None else None
    images = forward_inputs(visions, attention) if visions is not None else {}
    out = model(
        input_ids=ids, attention_mask=attention if padded else None,
        position_ids=positions if rope is None else rope, use_cache=True, logits_to_keep=1,
        **cache_kwargs(model, cache), **images,
    )
    delta = torch.zeros_like(positions[:, -1]) if rope is None else rope[0, :, -1] - positions[:, -1]  # (U,)
    return expand, ids, attention, positions, out.logits, delta


def _decode_shared_prompts(model, prompts: Prompts, sampler: CounterSampler, params, pad_id, eos, lockstep: bool,
                           sharded: bool) -> torch.Tensor:
    """(N, T) sampled ids: one prefill per distinct prompt, its KV cache copied to its rows, then a decode loop.
    Multimodal-RoPE models decode at text position + the prompt's own delta, in all three rows."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    shared = cache_kwargs(model, cache)  # past_key_values=, or cache= where the model takes it
    expand, ids, attention, positions, logits, delta = _prefill(model, prompts, pad_id, cache, device)
    padded = bool((attention == 0).any())
    cache.reorder_cache(expand)  # (U, ...) -> (N, ...): each prompt's keys and values copied to its G rows
    logits = logits[expand, -1].float()  # (N, V)
    seen, attention, position = ids[expand], attention[expand], positions[expand, -1]  # (N, P), (N, P), (N,)
    delta = delta[expand] if prompts.vision is not None and is_mrope(model) else None  # (N,)

    # the lean step reads weights directly: not from shards
    lean = LeanDecoder(model, cache, params.max_completion_length) \
        if supports_lean_decode(model) and not sharded and prompts.vision is None else None
    eos_ids = torch.tensor(eos, device=device)
    never = torch.tensor(placeholder_ids(model), dtype=torch.long, device=device)  # image tokens: never sampled
    min_new = int((params.generation_kwargs or {}).get("min_new_tokens") or 0)
    processors = _processors(params, None, penalties=True)
    track_seen = params.repetition_penalty != 1.0  # the only processor that reads the tokens so far
    finished = torch.zeros(len(prompts.ids), dtype=torch.bool, device=device)
    tokens, ended = [], None  # ended: how many tokens this process's rows needed (less than decoded in lockstep)
    for step in range(params.max_completion_length):
        if step < min_new:
            logits[:, eos_ids] = -float("inf")
        if never.numel():
            logits[:, never] = -float("inf")
        token = sampler.sample(processors(seen, logits) if processors else logits, step)  # (N,)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        finished |= torch.isin(token, eos_ids)
        if ended is None and bool(finished.all()):
            ended = step + 1
        if step + 1 == params.max_completion_length or _ended_everywhere(ended is not None, lockstep, device):
            break
        if track_seen:
            seen = torch.cat([seen, token.unsqueeze(-1)], 1)
        position = position + 1
        if padded:
            attention = torch.cat([attention, torch.ones_like(token).unsqueeze(-1)], 1)
        if lean is not None:
            logits = lean.step(token, position, attention.bool() if padded else None).float()
        else:
            at = position.unsqueeze(-1) if delta is None else (position + delta).view(1, -1, 1).expand(3, -1, -1)
            logits = model(
                input_ids=token.unsqueeze(-1), attention_mask=attention if padded else None,
                position_ids=at, use_cache=True, **shared,
            ).logits[:, -1].float()
    return torch.stack(tokens, 1)[:, :ended]


def _ended_everywhere(ended: bool, lockstep: bool, device: torch.device) -> bool:
    """True when this process's rows have all ended and, in lockstep (a sharded model not gathered for
    generation), every other process's too (each forward gathers weights collectively)."""
    if not lockstep:
        return ended
    running = torch.tensor([0 if ended else 1], dtype=torch.int32, device=device)
    dist.all_reduce(running)
    return int(running.item()) == 0


def _hf_generate(model, prompts: Prompts, sampler: CounterSampler, params, pad_id, eos, lockstep: bool,
                 sharded: bool) -> torch.Tensor:
    """(N, T) sampled ids through transformers.generate, for generation_kwargs the decode loop lacks (images:
    every row's own, as generate takes them)."""
    device = next(model.parameters()).device
    ids, attention = left_pad(prompts.ids, pad_id)
    ids, attention = ids.to(device), attention.to(device)
    images = forward_inputs(prompts.vision, attention) if prompts.vision is not None else {}
    # do_sample=False: the sampler (the last logits processor) has already drawn each token, leaving one choice.
    settings = dict(max_new_tokens=params.max_completion_length, repetition_penalty=params.repetition_penalty,
                    pad_token_id=pad_id, eos_token_id=eos)
    settings.update({k: v for k, v in (params.generation_kwargs or {}).items() if k != "do_sample"})
    config = GenerationConfig(do_sample=False, **settings)
    if placeholder_ids(model):
        config.suppress_tokens = sorted(set(config.suppress_tokens or []) | set(placeholder_ids(model)))
    sampler.prompt_length = ids.shape[1]
    out = model.generate(
        input_ids=ids, attention_mask=attention, generation_config=config,
        logits_processor=_processors(params, sampler), **images,
        synced_gpus=lockstep,  # every process runs forwards until all are done
    )
    return out[:, ids.shape[1] :]

"""The transformers `generate` rollout engine: prompts in, G completions per prompt out, masked after EOS."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpokit.rollout.sampling import GumbelNoise


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
class Rollout:
    """Completions of one batch, right-padded.

    completion_ids: (N, T) token ids (pad after the end); completion_mask: (N, T) 1 up to and including the
    first EOS; truncated: (N,) bool, True where no EOS was produced within max_completion_length.
    """

    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor


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


def mask_after_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, T) ids -> (N, T) mask keeping tokens up to and including the first EOS, and (N,) truncated flags."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    length = completion_ids.shape[1]
    has_eos = is_eos.any(-1)
    first_eos = torch.where(has_eos, is_eos.int().argmax(-1), torch.full_like(has_eos, length, dtype=torch.long))
    positions = torch.arange(length, device=completion_ids.device).unsqueeze(0)
    mask = (positions <= first_eos.unsqueeze(-1)).long()
    return mask, ~has_eos


def _processors(params: SamplingParams, noise: GumbelNoise) -> LogitsProcessorList:
    chain = []
    if params.temperature != 1.0:
        chain.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k > 0:
        chain.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        chain.append(TopPLogitsWarper(params.top_p))
    if params.min_p is not None:
        chain.append(MinPLogitsWarper(params.min_p))
    chain.append(noise)
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
) -> Rollout:
    """Sample one completion per entry of prompt_ids (the caller repeats each prompt G times).

    Args:
        prompt_ids: N token lists; sample_ids: (N,) global completion ids, which fix each completion's noise.
    """
    device = next(model.parameters()).device
    ids, attention = left_pad(prompt_ids, tokenizer.pad_token_id)
    ids, attention = ids.to(device), attention.to(device)
    eos = eos_token_ids(model, tokenizer)
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=params.max_completion_length,
        repetition_penalty=params.repetition_penalty,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        **(params.generation_kwargs or {}),
    )
    noise = GumbelNoise(seed, sample_ids, ids.shape[1])
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids, attention_mask=attention, generation_config=config,
            logits_processor=_processors(params, noise),
        )
    finally:
        model.train(was_training)
    completion = out[:, ids.shape[1] :]
    mask, truncated = mask_after_eos(completion, eos)
    completion = torch.where(mask.bool(), completion, torch.full_like(completion, tokenizer.pad_token_id))
    return Rollout(completion.cpu(), mask.cpu(), truncated.cpu())

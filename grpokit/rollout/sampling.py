"""Counter-based sampling: the token drawn for completion c at position t depends only on (seed, c, t) and the
logits, never on which other completions share the batch or the process.

The draw is inverse-CDF sampling with one uniform number per (completion, position): u = hash(seed, c, t) in
(0, 1), and the token is the first v whose cumulative probability exceeds u, i.e. the v with
F(v - 1) <= u < F(v), F(v) = sum_{w <= v} p_w. So a completion draws the same tokens whether it is generated alone,
in a batch of 64, on one process or split over eight; runs are reproducible across world sizes, and a resumed
run needs no sampler RNG state. Filtered tokens (top-k, top-p, min-p: score -inf) have p = 0 and are never drawn.

Cost per step, for N rows and a vocabulary of V: one exp and one blocked prefix sum over (N, V), plus a prefix
sum inside one block of each row. (The previous sampler hashed a Gumbel number for each of the N x V
entries: at V = 151,936 that took most of the decode step.)
"""

from __future__ import annotations

import math

import torch

from grpokit.algorithms.fused_head import EXP_FLOOR

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # an odd 27-bit multiplier: products stay inside int64
BLOCK = 512  # vocabulary entries per block of the two-level prefix sum
# exp(EXP_FLOOR) with room for exp's rounding: on a CPU, probabilities up to this (relative to the top token's) are
# dropped, whatever exp's last bit does at the floor (exponents clamped to EXP_FLOOR all land at or below it)
FLOORED_PROB = 2 * math.exp(EXP_FLOOR)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2^32."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def hashed_uniform(seed: int, sample_ids: torch.Tensor, position: int) -> torch.Tensor:
    """Uniform(0, 1) numbers, a pure function of (seed, sample id, position).

    Args:
        sample_ids: (B,) int64 global ids of the completions.
    Returns:
        (B,) float64 in the open interval (0, 1), with 53 random bits.
    """
    ids = sample_ids.long()
    row = _mix32((ids * 2654435761 + (seed & _MASK32)) & _MASK32)
    upper = ids >> 32  # ids from 2^32 up (eval samples, later turns of an episode) mix their upper bits in too
    row = torch.where(upper == 0, row, _mix32(row ^ _mix32((upper & _MASK32) ^ 0x27D4EB2F)))
    high = _mix32((row + position * 0x9E3779B1) & _MASK32)  # (B,)
    low = _mix32((high ^ 0x632BE5AB) + 0x85EBCA6B & _MASK32) >> 11  # 21 more bits
    return ((high << 21 | low).to(torch.float64) + 0.5) / 2.0**53


def inverse_cdf_sample(
    scores: torch.Tensor, uniform: torch.Tensor, scratch: torch.Tensor | None = None, with_logprob: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The token v with F(v - 1) <= u * F(V) < F(v) under p = softmax(scores), for each row.

    Args:
        scores: (N, V) processed logits; -inf marks a filtered token (at least one finite entry per row).
        uniform: (N,) float64 in (0, 1).
        scratch: optional (N, V) float32 buffer for the unnormalised probabilities, reused across steps.
        with_logprob: also return log p(v) = scores[v] - max - log sum exp(scores - max), from the sums the draw
            already made (no second pass over the vocabulary).
    Returns:
        (N,) int64 token ids, never one with p = 0; with_logprob: and their (N,) float32 log-probabilities.
    """
    rows, vocab = scores.shape
    scores = scores.float()
    top = scores.amax(-1, keepdim=True)
    # exp(z - max): unnormalised probabilities, enough because the target below is scaled by their total
    shifted = torch.sub(scores, top, out=scratch) if scratch is not None else scores - top  # (N, V)
    if scores.device.type == "cpu" and bool((shifted.amin(-1) < EXP_FLOOR).any()):
        # exponents below EXP_FLOOR (or -inf: filtered) would make exp return denormals, 5-9x slower on a CPU;
        # their probabilities (at most FLOORED_PROB of the top token's) become 0, which no 53-bit uniform can
        # tell apart. One threshold pass on the exps: a (N, V) mask and masked_fill took twice the exp's time.
        probs = torch.threshold_(shifted.clamp_(min=EXP_FLOOR).exp_(), FLOORED_PROB, 0.0)
    else:
        probs = shifted.exp_()
    full = vocab // BLOCK * BLOCK
    sums = probs[:, :full].reshape(rows, -1, BLOCK).sum(-1)  # (N, V // BLOCK), fp32 sums of 512 numbers
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], 1)
    block_cdf = sums.double().cumsum(-1)  # (N, blocks)
    target = (uniform.to(block_cdf) * block_cdf[:, -1]).unsqueeze(-1)  # (N, 1)
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True), _last_positive(sums))  # (N, 1)
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # (N, 1)
    index = block * BLOCK + torch.arange(BLOCK, device=scores.device)  # (N, BLOCK)
    inside = probs.gather(-1, index.clamp(max=vocab - 1)) * (index < vocab)
    inner_cdf = inside.double().cumsum(-1) + before
    offset = torch.minimum(torch.searchsorted(inner_cdf, target, right=True), _last_positive(inside))
    token = (block * BLOCK + offset).squeeze(-1)  # (N,)
    if not with_logprob:
        return token
    chosen = scores.gather(-1, token.unsqueeze(-1)) - top  # (N, 1)
    return token, (chosen.double() - block_cdf[:, -1:].log()).float().squeeze(-1)


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """(N, K) -> (N, 1) the last index k with values[:, k] > 0 (0 when none)."""
    return (torch.arange(values.shape[-1], device=values.device) * (values > 0)).amax(-1, keepdim=True)


class CounterSampler:
    """Draws each row's token with `inverse_cdf_sample` and the uniform hashed from (seed, sample id, position).

    `sample(scores, position)` is what the decode loop calls. Called as a transformers LogitsProcessor (put it
    last, after temperature / top-k / top-p / min-p), it leaves only the drawn token finite, so greedy decoding
    in `generate` returns the sampled token.
    """

    def __init__(self, seed: int, sample_ids: torch.Tensor, prompt_length: int, record_logprobs: bool = False) -> None:
        self.seed = seed
        self.sample_ids = sample_ids
        self.prompt_length = prompt_length
        self.record_logprobs = record_logprobs
        self.logprobs: list[torch.Tensor] = []
        self._scratch: torch.Tensor | None = None

    def sample(self, scores: torch.Tensor, position: int) -> torch.Tensor:
        """(N, V) processed logits at completion position `position` -> (N,) token ids.

        With `record_logprobs` set, the drawn tokens' log-probabilities are appended to `logprobs` ((N,) each).
        """
        uniform = hashed_uniform(self.seed, self.sample_ids.to(scores.device), position)
        if self._scratch is None or self._scratch.shape != scores.shape:
            self._scratch = torch.empty(scores.shape, dtype=torch.float32, device=scores.device)
        if not self.record_logprobs:
            return inverse_cdf_sample(scores, uniform, self._scratch)
        token, logprob = inverse_cdf_sample(scores, uniform, self._scratch, with_logprob=True)
        self.logprobs.append(logprob)
        return token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self.sample(scores, input_ids.shape[1] - self.prompt_length)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(-1, token.unsqueeze(-1), 0.0)

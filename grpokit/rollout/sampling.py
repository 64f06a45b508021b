"""Counter-based sampling: the token drawn for completion c at position t depends only on (seed, c, t) and the
logits, never on which other completions share the batch or the process.

Sampling from softmax(s) equals argmax(s + g) with g_v i.i.d. Gumbel(0, 1) noise (the Gumbel-max trick). Here
g_v = -log(-log(u_v)) with u_v a hash of (seed, c, t, v), so a completion draws the same tokens whether it is
generated alone, in a batch of 64, on one process or split over eight: runs are reproducible across world
sizes, and a resumed run needs no sampler RNG state. Filtered tokens (top-k, top-p, min-p) keep score -inf.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # an odd 27-bit multiplier: products stay inside int64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values < 2^32."""
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    x = ((x >> 16) ^ x) * _MULT & _MASK32
    return (x >> 16) ^ x


def hashed_uniform(seed: int, sample_ids: torch.Tensor, position: int, vocab_size: int) -> torch.Tensor:
    """Uniform(0, 1) numbers, a pure function of (seed, sample id, position, vocabulary index).

    Args:
        sample_ids: (B,) int64 global ids of the completions.
    Returns:
        (B, V) float32 in the open interval (0, 1).
    """
    device = sample_ids.device
    row = _mix32((sample_ids.long() * 2654435761 + (seed & _MASK32)) & _MASK32)
    row = _mix32((row + position * 0x9E3779B1) & _MASK32)  # (B,)
    vocab = torch.arange(vocab_size, device=device, dtype=torch.int64)
    bits = _mix32((row.unsqueeze(-1) ^ _mix32(vocab + 0x632BE5AB)) & _MASK32)  # (B, V)
    return (bits.to(torch.float64) + 0.5).div_(2**32).to(torch.float32)


class GumbelNoise:
    """A transformers LogitsProcessor that turns greedy decoding into counter-based sampling.

    Put it last, after temperature / top-k / top-p / min-p: argmax(scores + Gumbel) then samples from the
    filtered, tempered distribution.
    """

    def __init__(self, seed: int, sample_ids: torch.Tensor, prompt_length: int) -> None:
        self.seed = seed
        self.sample_ids = sample_ids
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        position = input_ids.shape[1] - self.prompt_length
        u = hashed_uniform(self.seed, self.sample_ids.to(scores.device), position, scores.shape[-1])
        gumbel = -torch.log(-torch.log(u))
        return scores.float() + gumbel

"""Per-token log-probabilities and entropies of completion tokens, computed in bounded memory.

A vocabulary is large (150k for Qwen) and a batch has many positions, so `log_softmax(logits)` would allocate a
second (B, T, V) tensor. Here the sampled token's logit is *gathered* first and the normaliser `logsumexp` is taken
chunk by chunk over the flattened positions, so the extra memory is one chunk of at most `chunk_elements` numbers:

    log pi(y_t | x, y_<t) = z_t[y_t] / tau - logsumexp_v(z_t[v] / tau)
    H_t = logsumexp_v(z_t / tau) - sum_v softmax(z_t / tau)[v] * z_t[v] / tau

Temperature tau is applied here because the rollout sampled from softmax(z / tau): the ratio and the KL must be
measured on the same distribution that produced the tokens (TRL does the same).
"""

from __future__ import annotations

import torch

# One chunk holds at most this many logits (64 MiB in fp32).
DEFAULT_CHUNK_ELEMENTS = 1 << 24
# The chunk of a pass without gradients (reference / old log-probs), which holds no activations, head gradients
# or optimizer step beside it: twice as many rows make the head's product faster (at the real vocabulary, 220
# rows instead of 110: the no-grad head pass 18% faster in fp32, 10% in bf16; benchmarks/README.md) for 64 MiB
# more in a phase that peaks well below the update.
NO_GRAD_CHUNK_ELEMENTS = 1 << 25


def chunk_rows(vocab_size: int, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Positions per chunk: as many as keep one chunk's (C, V) logits within chunk_elements, at least 1."""
    return max(1, chunk_elements // max(1, vocab_size))


def _row_chunks(num_rows: int, vocab_size: int, chunk_elements: int):
    step = chunk_rows(vocab_size, chunk_elements)
    for start in range(0, num_rows, step):
        yield slice(start, min(num_rows, start + step))


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Log-probability of each given token under softmax(logits / temperature).

    Args:
        logits: (B, T, V) scores whose position t predicts token_ids[:, t] (already shifted by the caller).
        token_ids: (B, T) integer token ids.
        temperature: tau > 0, the sampling temperature of the rollout.
        chunk_elements: at most this many logits are normalised at once.
    Returns:
        (B, T) float32 log-probabilities; differentiable with respect to logits.
    """
    batch, length, vocab = logits.shape
    flat_logits = logits.reshape(batch * length, vocab)  # (B*T, V), a view
    flat_ids = token_ids.reshape(batch * length, 1)
    pieces = []
    for rows in _row_chunks(batch * length, vocab, chunk_elements):
        chunk = flat_logits[rows].float() / temperature  # (C, V)
        chosen = chunk.gather(-1, flat_ids[rows]).squeeze(-1)  # (C,)
        pieces.append(chosen - torch.logsumexp(chunk, dim=-1))
    return torch.cat(pieces).reshape(batch, length)


def token_entropy(
    logits: torch.Tensor, temperature: float = 1.0, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    differentiable: bool = False,
) -> torch.Tensor:
    """Entropy (nats) of softmax(logits / temperature) at every position.

    Args:
        logits: (B, T, V).
        differentiable: keep the graph (an entropy bonus in the loss; holds each chunk's probabilities for the
            backward); False: a metric, computed without gradient.
    Returns:
        (B, T) float32 entropies H_t = lse(z/tau) - sum_v p_v z_v/tau.
    """
    with torch.set_grad_enabled(differentiable and torch.is_grad_enabled()):
        return _token_entropy(logits, temperature, chunk_elements)


def _token_entropy(logits: torch.Tensor, temperature: float, chunk_elements: int) -> torch.Tensor:
    batch, length, vocab = logits.shape
    flat_logits = logits.reshape(batch * length, vocab)
    pieces = []
    for rows in _row_chunks(batch * length, vocab, chunk_elements):
        chunk = flat_logits[rows].float() / temperature  # (C, V)
        lse = torch.logsumexp(chunk, dim=-1, keepdim=True)  # (C, 1)
        probs = torch.exp(chunk - lse)
        pieces.append(lse.squeeze(-1) - (probs * chunk).sum(-1))
    return torch.cat(pieces).reshape(batch, length)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where mask is 1; 0 when the mask is empty. Shapes: any, equal."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)

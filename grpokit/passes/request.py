"""What a log-prob pass is asked for, and what it gives back: one frozen request, one result type."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, NO_GRAD_CHUNK_ELEMENTS
from grpokit.passes.packing import Layout

# token_loss(logp (n,), entropy (n,) or None, rows (n,), cols (n,)) -> (): a loss that sums functions of each
# completion token's log-prob (and entropy), given the tokens at (rows, cols) of the (b, T) batch.
TokenLoss = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Tokens:
    """A batch as the passes read it: (b, P) left-padded prompt ids and mask, (b, T) right-padded completion ids
    and mask, all on the model's device; vision: each row's prompt images (grpokit.vision.PromptVision, None for a
    row without), or None for a text-only batch."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    vision: tuple | None = None

    def to(self, device) -> "Tokens":
        return Tokens(self.prompt_ids.to(device), self.prompt_mask.to(device), self.completion_ids.to(device),
                      self.completion_mask.to(device), self.vision)

    @property
    def has_images(self) -> bool:
        return self.vision is not None and any(v is not None for v in self.vision)


@dataclasses.dataclass(frozen=True)
class PassRequest:
    """How to run a pass.

    temperature: log-probs under softmax(logits / temperature). entropy: also the per-token entropies;
    entropy_grad: they are differentiable (an entropy bonus), else a metric. chunk_elements: the most logits that
    exist at once (None: DEFAULT_CHUNK_ELEMENTS with gradients, NO_GRAD_CHUNK_ELEMENTS without).
    token_loss: the loss computed inside the pass (`TokenLoss`); then the result's log-probs and entropies are
    detached, and with a plain linear head the head's gradients are computed in its forward
    (`algorithms.head_token_loss`). into_grad (with token_loss): dL/dW is summed straight into the head weight's
    `.grad` (`train.in_place` decides where). pack: the padding-free forward where the model packs;
    share_prompts: each distinct prompt runs once on the padded path (not under DDP with gradients, gradient
    checkpointing or a fully sharded model); share_images: where prompts are not shared, each distinct prompt's
    images are still encoded once (one get_image_features call, its outputs gathered per row; not for a sharded
    model, whose tower would run outside the root's forward); layout: the packed rows of a token-budgeted forward
    (None: planned here)."""

    temperature: float = 1.0
    entropy: bool = False
    entropy_grad: bool = False
    chunk_elements: int | None = None
    token_loss: TokenLoss | None = None
    into_grad: bool = False
    pack: bool = True
    share_prompts: bool = True
    share_images: bool = True
    layout: Layout | None = None

    def resolved(self) -> "PassRequest":
        """The request with its chunk size fixed for the current grad mode."""
        if self.chunk_elements is not None:
            return self
        chunk = DEFAULT_CHUNK_ELEMENTS if torch.is_grad_enabled() else NO_GRAD_CHUNK_ELEMENTS
        return dataclasses.replace(self, chunk_elements=chunk)


@dataclasses.dataclass(frozen=True)
class PassResult:
    """logprobs: (b, T) float32 log-probs of the completion tokens (position t is completion token t; 0 where the
    pass did not compute one), differentiable unless a loss was computed in the pass. entropies: (b, T) or None.
    loss: the request's token_loss summed over the batch's completion tokens, or None."""

    logprobs: torch.Tensor
    entropies: torch.Tensor | None = None
    loss: torch.Tensor | None = None

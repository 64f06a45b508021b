"""Whether a training step sums gradients straight into `.grad`: one decision, made once, with its reason.

Two CPU-measured savings write gradients into a parameter's `.grad` themselves instead of handing autograd a
second (V, H) tensor to add there (155 MB each at a vocabulary of 151,936 and H = 256, fp32):
- the fused head's dL/dW (`algorithms.head_token_loss(into_grad=True)`), summed in its forward;
- the input embedding's rows (`train.memory.embedding_rows_into_grad`), `index_add_`-ed in its backward.

Both are exact only where nothing but autograd watches the gradients, and both were measured on a CPU alone
(docs/performance.md: ~115 ms and 155 MB a backward each at the real vocabulary). So they are on only where all of
this holds, and `reason` says which condition turned them off:
- the device is a CPU. On CUDA `index_add_` accumulates with atomics (runs stop being bit-exact), and no GPU
  measurement shows a gain yet: off until one does (benchmarks/gpu_check.sh);
- the policy is not sharded (FSDP2 reduce-scatters each backward's gradient, which must come from autograd);
- it is not wrapped in DDP (its hooks all-reduce the gradient autograd hands them);
- no gradient scaler (the backward's upstream gradient is the scale, not 1);
- accelerate does not divide the loss (its gradient_accumulation_steps is 1: grpokit accumulates micro-batches).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class InPlaceGradients:
    """enabled: gradients may be summed into `.grad` in place; reason: why (the first condition that failed)."""

    enabled: bool
    reason: str


def in_place_gradients(model: torch.nn.Module, accelerator, sharded: bool, device: torch.device) -> InPlaceGradients:
    """The decision for the policy `model` as the learner holds it (wrapped or not), on `device`."""
    if device.type != "cpu":
        return InPlaceGradients(False, f"off on {device.type}: measured on a CPU only, and on a GPU the "
                                       "embedding's index_add_ uses atomics (not bit-exact)")
    if sharded:
        return InPlaceGradients(False, "off under FSDP: its reduce-scatter takes the gradient autograd hands it")
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return InPlaceGradients(False, "off under DDP: its hooks all-reduce the gradient autograd hands them")
    if getattr(accelerator, "scaler", None) is not None:
        return InPlaceGradients(False, "off with a gradient scaler: the backward's upstream gradient is not 1")
    if getattr(accelerator, "gradient_accumulation_steps", 1) != 1:
        return InPlaceGradients(False, "off: accelerate divides the loss (its gradient_accumulation_steps != 1)")
    return InPlaceGradients(True, "on: one process on a CPU, and nothing but autograd handles the gradients")

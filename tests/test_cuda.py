"""CUDA-only tests: the code paths of grpokit that only a GPU takes, run on the device against references.

Every test here is marked `cuda`; conftest.py skips them, with the reason, where torch.cuda.is_available() is
False, and benchmarks/gpu_check.sh runs them on a lent GPU (`pytest -m cuda tests/test_cuda.py`). Each has a CPU
counterpart elsewhere in tests/ (named in its docstring); the tests are written for any device, but they exist for
the branches a CPU never reaches:

- the fused LM head (grpokit/algorithms/fused_head.py): on CUDA under autocast dL/dW is a bf16 product per chunk
  summed into the fp32 gradient (`_accumulate`), head_token_loss takes its products and narrowed dL/dz through a
  (C, V) scratch buffer instead of the CPU's shared-bytes buffer (`forward_buffers`), `_operands` casts under
  CUDA's autocast, and head_token_loss's backward scales its gradients in place (or asserts into_grad's upstream
  gradient of 1 with `_assert_async`) instead of reading the upstream gradient. head_logprobs and head_token_loss
  in fp32, under bf16 autocast and with a bf16 model (no autocast); values and gradients against fp64 autograd
  on the full logits (`torch.log_softmax` in fp64); with entropies (as a metric, and with their gradient), a
  bias, temperatures other than 1, chunks that split the rows unevenly (and blocks that split the chunks
  unevenly), a frozen head, into_grad, and the real vocabulary;
- packing: the padding-free pass against the padded one on the GPU (sdpa; flash_attention_2 where flash_attn is
  installed);
- GRPOTrainer steps with bf16=True on the GPU, through the packed forward and the loss inside the head;
- FSDP2 over NCCL at world size 1 (torchrun): two sharded steps, a DCP checkpoint, and a resume from it;
- the in-place gradients decision (grpokit.train.in_place): off on CUDA, with a reason.

Tolerances, by dtype (the measured errors are in every failure message):
- fp32 (TF32 off here, `fp32_matmuls_in_fp32`): log-probs and entropies within 1e-5; gradients within 1e-5 of the
  largest entry of the fp64 reference (1e-4 at the real vocabulary, where dL/dh sums 151,936 products).
- bf16 (autocast, or a bf16 model): the reference takes the operands as the products see them (h, W and b rounded
  to bf16), so what remains is the head's own rounding. Each product h.W_v is rounded to bf16: off by at most
  delta_v = 2^-8 |h.W_v| / tau after the temperature. To first order log pi(y) = z_y - lse is then off by at most
  delta_y + sum_v p_v delta_v and the entropy by sum_v p_v |z_v - E_p z| delta_v: each row is checked against its
  own bound (x 1.1, + 2e-5 for fp32's exp and sums). Gradients (dL/dz narrowed to bf16, the bf16 products of
  dL/dh and, on CUDA, of each chunk's dL/dW, a bf16 model's gradients rounded to bf16): within 2e-2 of the largest
  reference entry and 1e-2 in norm (relative).
- packed against padded (whole models): fp32 5e-5 (relative to each gradient's largest entry), bf16 5e-2.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__":  # the FSDP worker (`fsdp_worker`, run by torchrun): this checkout's grpokit and helpers
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import pytest  # noqa: E402
import torch  # noqa: E402

# GRPOKIT_CUDA_TESTS_DEVICE=cpu: a dry run of these tests' own code on a CPU (conftest.py then does not skip them)
DEVICE = torch.device(os.environ.get("GRPOKIT_CUDA_TESTS_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"
pytestmark = pytest.mark.cuda

VOCAB, WIDTH = 1001, 64  # 39 positions per head test: chunks of 5 rows are 7 x 5 + 4
MODES = ["fp32", "autocast", "bf16"]  # fp32 tensors; fp32 tensors under bf16 autocast; bf16 tensors, no autocast
BF16_HALF_ULP = 2.0 ** -8  # |bf16(x) - x| <= 2^-8 |x| (8 significant bits, rounded to nearest)


@pytest.fixture(autouse=True)
def fp32_matmuls_in_fp32():
    """TF32 off, so that fp32 here means fp32 (torch's default; pinned in case anything imported changed it)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def spy(setattr_, module, name: str, record) -> None:
    """Wrap `module.name` (a function): record(*args, **kwargs) runs before each call."""
    function = getattr(module, name)

    @functools.wraps(function)
    def spied(*args, **kwargs):
        record(*args, **kwargs)
        return function(*args, **kwargs)

    setattr_(module, name, spied)


def small_blocks(monkeypatch, vocab: int, rows: int) -> None:
    """`_chunk_stats` works on blocks of `rows` rows (STATS_ELEMENTS)."""
    from grpokit.algorithms import head_buffers

    monkeypatch.setattr(head_buffers, "STATS_ELEMENTS", rows * vocab)


def autocast(mode: str):
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()


# ---------------------------------------------------------------------------- the fused head: references
def head_inputs(n: int, vocab: int, width: int, bias: bool, mode: str, seed: int = 0, w_scale: float = 0.125):
    """(hidden, weight, bias) leaves on DEVICE that require grad (bf16 for mode "bf16"), targets, and upstream
    gradients for the log-probs and the entropies. Logits h.W_v are ~N(0, (sqrt(width) w_scale)^2)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) * w_scale
    b = torch.randn(vocab, generator=g) * 0.5 if bias else None
    targets = torch.randint(0, vocab, (n,), generator=g)
    g_logp, g_entropy = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    leaves = [None if t is None else t.to(DEVICE, dtype).requires_grad_() for t in (hidden, weight, b)]
    return leaves, targets.to(DEVICE), g_logp.to(DEVICE), g_entropy.to(DEVICE)


def as_seen(t: torch.Tensor | None, mode: str) -> torch.Tensor | None:
    """An operand as the head's products see it, in fp64: rounded to bf16 under autocast (and bf16 already in a
    bf16 model)."""
    return None if t is None else (t.detach() if mode == "fp32" else t.detach().bfloat16()).double()


@dataclass
class Reference:
    logp: torch.Tensor  # (N,) fp64
    entropy: torch.Tensor  # (N,)
    loss: torch.Tensor  # () sum g_logp logp (+ sum g_entropy H)
    grads: tuple  # d loss / d (hidden, weight[, bias]) in fp64
    bound_logp: torch.Tensor  # (N,) first-order bound of the bf16 products' rounding on log pi(y); zeros for fp32
    bound_entropy: torch.Tensor  # (N,)


def reference(leaves, targets, temperature: float, g_logp, g_entropy, mode: str) -> Reference:
    """fp64 autograd on the full logits: z = (h W^T + b) / tau, log_softmax, the chosen tokens' log-probs, the
    entropies, and the gradients of sum g_logp log pi (+ sum g_entropy H where g_entropy is given)."""
    h, w, b = (None if t is None else as_seen(t, mode).requires_grad_() for t in leaves)
    raw = h @ w.T  # (N, V): the head's product before bias and temperature
    logits = (raw if b is None else raw + b) / temperature
    logp_all = torch.log_softmax(logits, -1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(p * logp_all).sum(-1)
    loss = (logp * g_logp.double()).sum()
    if g_entropy is not None:
        loss = loss + (entropy * g_entropy.double()).sum()
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    with torch.no_grad():
        if mode == "fp32":
            bound_logp = bound_entropy = torch.zeros_like(logp)
        else:
            delta = BF16_HALF_ULP * raw.abs() / temperature  # (N, V) the rounding of each product, tempered
            bound_logp = delta.gather(-1, targets.unsqueeze(-1)).squeeze(-1) + (p * delta).sum(-1)
            mean = (p * logits).sum(-1, keepdim=True)
            bound_entropy = (p * (logits - mean).abs() * delta).sum(-1)
    return Reference(logp.detach(), entropy.detach(), loss.detach(), grads, bound_logp, bound_entropy)


def assert_values_close(ours: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, mode: str, name: str):
    """fp32: within 1e-5. bf16: every row within 1.1 x its rounding bound + 2e-5."""
    error = (ours.double() - expected).abs()
    allowed = torch.full_like(error, 1e-5) if mode == "fp32" else 1.1 * bound + 2e-5
    worst = int((error - allowed).argmax())
    assert bool((error <= allowed).all()), (
        f"{name} ({mode}): row {worst} off by {error[worst].item():.3g}, allowed {allowed[worst].item():.3g}; "
        f"largest error {error.max().item():.3g}, largest bound {allowed.max().item():.3g}")


def assert_grads_close(ours: torch.Tensor, expected: torch.Tensor, mode: str, name: str, fp32_tol: float = 1e-5):
    """fp32: max |error| <= fp32_tol x max(largest entry, 1). bf16: max |error| <= 2e-2 x largest entry and
    |error| / |expected| <= 1e-2 (norms)."""
    difference = ours.detach().double() - expected
    scale = expected.abs().max().item()
    worst = difference.abs().max().item()
    relative = (difference.norm() / expected.norm().clamp(min=1e-30)).item()
    if mode == "fp32":
        ok = worst <= fp32_tol * max(scale, 1.0)
    else:
        ok = worst <= 2e-2 * scale and relative <= 1e-2
    assert ok, f"{name} ({mode}): max |error| {worst:.3g} (largest entry {scale:.3g}), norm-relative {relative:.3g}"


def check_head(leaves, ref: Reference, logp, entropy, mode: str, grads=None, fp32_tol: float = 1e-5) -> None:
    """Values (fp32 on DEVICE), the gradients' dtypes, and the gradients against the reference."""
    assert logp.dtype == torch.float32 and logp.device.type == DEVICE.type
    assert_values_close(logp, ref.logp, ref.bound_logp, mode, "log-probs")
    assert_values_close(entropy, ref.entropy, ref.bound_entropy, mode, "entropies")
    names = ["dL/dh", "dL/dW", "dL/db"]
    present = [(t, n) for t, n in zip(leaves, names) if t is not None]
    grads = grads or [t.grad for t, _ in present]
    for (leaf, name), ours, theirs in zip(present, grads, ref.grads):
        assert ours is not None, f"{name}: no gradient"
        assert ours.dtype == leaf.dtype and ours.device == leaf.device, (name, ours.dtype, ours.device)
        assert_grads_close(ours, theirs, mode, name, fp32_tol)


# ---------------------------------------------------------------------------- the fused head on CUDA
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("rows", [5, 64])  # 39 positions: 7 chunks of 5 and one of 4; all in one chunk
def test_head_logprobs_on_the_device_equals_fp64_on_the_full_logits(mode, bias, temperature, entropy_grad, rows,
                                                                    monkeypatch):
    """head_logprobs' forward and recomputing backward (CPU: test_fused_logprobs.py): blocks of 2 rows inside the
    chunks (a chunk of 5 is 2 + 2 + 1), entropies as a metric and with their gradient."""
    from grpokit.algorithms import head_logprobs

    small_blocks(monkeypatch, VOCAB, 2)
    leaves, targets, g_logp, g_entropy = head_inputs(39, VOCAB, WIDTH, bias, mode)
    hidden, weight, b = leaves
    with autocast(mode):
        logp, entropy = head_logprobs(hidden.view(3, 13, WIDTH), weight, b, targets.view(3, 13), temperature,
                                      with_entropy=True, chunk_elements=rows * VOCAB, entropy_grad=entropy_grad)
    assert logp.shape == entropy.shape == (3, 13) and entropy.requires_grad == entropy_grad
    loss = (logp.reshape(-1) * g_logp).sum()
    if entropy_grad:
        loss = loss + (entropy.reshape(-1) * g_entropy).sum()
    loss.backward()
    ref = reference(leaves, targets, temperature, g_logp, g_entropy if entropy_grad else None, mode)
    check_head(leaves, ref, logp.reshape(-1), entropy.reshape(-1), mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("entropy_grad", [False, True])  # False: each block's softmax replaces its logits
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("into_grad", [False, True])
def test_head_token_loss_on_the_device_equals_fp64_on_the_full_logits(mode, entropy_grad, bias, into_grad,
                                                                      monkeypatch):
    """head_token_loss computes the gradients in its forward (CPU: test_fused_logprobs.py, test_packing.py): the
    probs path (no entropy gradient) and the kept-logits path, dL/dW summed on top of an earlier micro-batch's
    gradient, by autograd or straight into weight.grad (into_grad, where the weight is fp32: its upstream gradient
    of 1 asserted on the device); without into_grad the loss is backpropagated scaled by 2.5 (the backward scales
    the forward's gradients in place on a device); chunks of 5 rows (7 x 5 + 4), blocks of 2."""
    from grpokit.algorithms import head_token_loss

    small_blocks(monkeypatch, VOCAB, 2)
    leaves, targets, g_logp, g_entropy = head_inputs(39, VOCAB, WIDTH, bias, mode, seed=1)
    hidden, weight, b = leaves
    # an earlier micro-batch's dL/dW (zeros for a bf16 weight, whose sum with it would be rounded to bf16)
    earlier = torch.zeros_like(weight) if mode == "bf16" else torch.full_like(weight, 0.25)
    weight.grad = earlier.clone()

    def token_loss(x, e, part):
        value = (x * g_logp[part]).sum()
        return value + (e * g_entropy[part]).sum() if entropy_grad else value

    with autocast(mode):
        loss, logp, entropy = head_token_loss(hidden, weight, b, targets, token_loss, 0.7, with_entropy=True,
                                              chunk_elements=5 * VOCAB, into_grad=into_grad,
                                              entropy_grad=entropy_grad)
    upstream = 1.0 if into_grad else 2.5
    (upstream * loss).backward()
    ref = reference(leaves, targets, 0.7, g_logp, g_entropy if entropy_grad else None, mode)
    ref.grads = tuple(upstream * g for g in ref.grads)
    check_head(leaves, ref, logp, entropy, mode,
               grads=[hidden.grad, weight.grad - earlier] + ([b.grad] if bias else []))
    allowed = 1e-5 * (g_logp.abs().sum().item() + (g_entropy.abs().sum().item() if entropy_grad else 0.0))
    if mode != "fp32":
        allowed = 1.1 * ((g_logp.double().abs() * ref.bound_logp).sum().item()
                         + ((g_entropy.double().abs() * ref.bound_entropy).sum().item() if entropy_grad else 0.0)) \
            + 1e-4
    assert abs(loss.item() - ref.loss.item()) <= allowed, (loss.item(), ref.loss.item(), allowed)


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
@pytest.mark.parametrize("fused_loss", [False, True])
def test_a_frozen_head_gives_the_hidden_states_their_gradient(mode, fused_loss):
    """A frozen head (LoRA on the layers, the head untouched): no dL/dW is computed, dL/dh still is (on CUDA under
    autocast, dL/dz is narrowed into the scratch buffer for dL/dh alone)."""
    from grpokit.algorithms import head_logprobs, head_token_loss

    leaves, targets, g_logp, _ = head_inputs(39, VOCAB, WIDTH, True, mode, seed=2)
    hidden, weight, b = leaves
    weight.requires_grad_(False)
    b.requires_grad_(False)
    with autocast(mode):
        if fused_loss:
            loss, logp, entropy = head_token_loss(hidden, weight, b, targets,
                                                  lambda x, e, part: (x * g_logp[part]).sum(), 1.3, True, 5 * VOCAB)
        else:
            logp, entropy = head_logprobs(hidden, weight, b, targets, 1.3, True, 5 * VOCAB)
            loss = (logp * g_logp).sum()
    loss.backward()
    assert weight.grad is None and b.grad is None
    ref = reference(leaves, targets, 1.3, g_logp, None, mode)
    check_head([hidden, None, None], ref, logp, entropy, mode, grads=[hidden.grad])


@pytest.mark.parametrize("mode", ["fp32", "autocast"])
def test_the_real_vocabulary_in_the_default_chunks(mode):
    """A 151,936-entry vocabulary at the default chunk (110 rows: 250 positions are 110 + 110 + 30) and the default
    blocks (13 rows: 110 = 8 x 13 + 6): head_logprobs with entropies, and head_token_loss (the probs path) on the
    same inputs."""
    from grpokit.algorithms import head_logprobs, head_token_loss
    from grpokit.tiny import REAL_VOCAB_SIZE

    leaves, targets, g_logp, _ = head_inputs(250, REAL_VOCAB_SIZE, 128, False, mode, seed=3, w_scale=0.1)
    hidden, weight, _ = leaves
    ref = reference(leaves, targets, 0.9, g_logp, None, mode)
    with autocast(mode):
        logp, entropy = head_logprobs(hidden, weight, None, targets, 0.9, True)
    (logp * g_logp).sum().backward()
    check_head(leaves, ref, logp, entropy, mode, fp32_tol=1e-4)  # fp32: dL/dh sums 151,936 products
    hidden.grad = weight.grad = None
    with autocast(mode):
        loss, logp2, entropy2 = head_token_loss(hidden, weight, None, targets,
                                                lambda x, e, part: (x * g_logp[part]).sum(), 0.9, True,
                                                entropy_grad=False)
    loss.backward()
    check_head(leaves, ref, logp2, entropy2, mode, fp32_tol=1e-4)


# ---------------------------------------------------------------------------- packing on the device
@pytest.fixture
def always_packed(monkeypatch):
    """These tiny batches are below the sizes where grpokit packs by itself (PACK_WHEN): force it, and count the
    packed forwards."""
    from grpokit.passes import dispatch, packing

    monkeypatch.setattr(dispatch, "PACK_WHEN", float("inf"))
    calls = []
    spy(monkeypatch.setattr, packing, "build", lambda *a, **k: calls.append(1))  # one per packed forward
    return calls


def passes(model, batch, pack: bool, mode: str):
    """(log-probs, entropies, gradients) of a packed or padded pass over `batch` on DEVICE, with an entropy bonus
    (as test_packing.values_and_grads)."""
    from grpokit.passes import completion_logprobs

    model.zero_grad(set_to_none=True)
    batch = [t.to(DEVICE) for t in batch]
    mask = batch[3].float()
    upstream = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE) * mask
    with autocast(mode):
        logp, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True, pack=pack,
                                            share_prompts=False, entropy_grad=True)
        loss = (logp * upstream).sum() + 0.3 * (entropy * mask).sum()
    loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logp * mask).detach(), (entropy * mask).detach(), grads


def assert_passes_close(packed, padded, tol: float, what: str) -> None:
    for name, a, b in (("log-probs", packed[0], padded[0]), ("entropies", packed[1], padded[1])):
        error = (a - b).abs().max().item()
        assert error <= tol, f"{what}: {name} differ by {error:.3g} > {tol}"
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name, expected in padded[2].items():
        scale = expected.abs().max().clamp(min=1e-6).item()
        error = (packed[2][name] - expected).abs().max().item()
        assert error <= tol * scale, f"{what}: gradient of {name} off by {error:.3g} (largest entry {scale:.3g})"


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied heads
@pytest.mark.parametrize("mode", ["fp32", "autocast"])
def test_packed_equals_padded_with_sdpa_on_the_device(always_packed, family, mode):
    """test_packing.test_packed_equals_padded_values_and_gradients on the GPU: the block-causal bool mask through
    the GPU's SDPA kernels, and the fused head on the completion tokens only."""
    from test_packing import family_model, ragged_batch

    model = family_model(family).to(DEVICE)
    batch = ragged_batch()
    packed = passes(model, batch, True, mode)
    assert always_packed == [1]
    padded = passes(model, batch, False, mode)
    assert always_packed == [1]
    assert_passes_close(packed, padded, 5e-5 if mode == "fp32" else 5e-2, f"{family} {mode}")


def test_packed_flash_attention_varlen_equals_padded_sdpa(always_packed):
    """test_varlen.py's check with the real flash-attn kernels: the packed one-row layout through
    flash_attn_varlen_func (a bf16 model: flash-attn has no fp32 kernels) against the padded sdpa pass."""
    if not ON_GPU:
        pytest.skip("flash_attention_2 runs on CUDA only")
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash_attn is not installed on this machine: the varlen path runs only against the stand-in "
                    "kernel of tests/test_varlen.py")
    from grpokit.passes import varlen
    from test_packing import family_model, ragged_batch

    model = family_model("qwen2").to(DEVICE, torch.bfloat16)
    model.config._attn_implementation = "flash_attention_2"
    assert varlen(model)
    batch = ragged_batch()
    packed = passes(model, batch, True, "bf16")
    assert always_packed == [1]
    model.config._attn_implementation = "sdpa"
    assert_passes_close(packed, passes(model, batch, False, "bf16"), 5e-2, "flash varlen against sdpa")


# ---------------------------------------------------------------------------- training on the device
@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])  # the head's probs path; its kept-logits path
def test_bf16_autocast_training_steps_on_the_device(tiny_model_dir, tmp_path, prompt_dataset, always_packed,
                                                    monkeypatch, entropy_coef):
    """Three GRPOTrainer steps with bf16=True (CPU: test_trainer.py): the policy on the GPU, its passes packed and
    the loss inside the head under CUDA autocast; finite metrics, every parameter moved."""
    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.passes import heads as head_module
    from grpokit.train import learner_step
    from helpers import frac_a, read_jsonl

    monkeypatch.setattr(learner_step, "FUSED_LOSS_MIN_HEAD", 0)  # the tiny head: below where the loss goes inside
    heads = []
    spy(monkeypatch.setattr, head_module, "head_token_loss",
        lambda hidden, *a, **k: heads.append((hidden.device.type, torch.is_autocast_enabled(hidden.device.type))))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=12, learning_rate=1e-2, bf16=True, beta=0.04, entropy_coef=entropy_coef,
                      seed=0, logging_steps=1, disable_tqdm=True, save_strategy="no", report_to=[])
    trainer = GRPOTrainer(tiny_model_dir, [frac_a], args, prompt_dataset)
    model = trainer.learner.unwrapped
    assert {p.device.type for p in model.parameters()} == {DEVICE.type}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in ("loss", "kl", "grad_norm", "entropy", "reward"):
            assert math.isfinite(row[key]), (key, row)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert sorted(moved) == sorted(before)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # autocast: fp32 weights
    assert heads and set(heads) == {(DEVICE.type, True)}  # the loss inside the head, under autocast
    assert always_packed  # the padding-free passes


# ---------------------------------------------------------------------------- FSDP2 over NCCL, one process
def fsdp_worker(model_dir: str, out: str, resume: bool) -> None:
    """Run by `torchrun --nproc_per_node 1 tests/test_cuda.py fsdp-worker MODEL_DIR OUT [--resume]`: two GRPO steps
    with the model sharded by FSDP2 over a one-process NCCL group (gloo on a CPU), bf16 compute (FSDP's
    MixedPrecisionPolicy), a sharded (DCP) checkpoint after every step; --resume continues from OUT's newest
    checkpoint. Prints one line `RESULTS {json}`."""
    import logging

    import datasets
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from grpokit import GRPOConfig, GRPOTrainer
    from grpokit.train.fsdp import run_options
    from helpers import short

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # "Resumed from ..."
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        torch.use_deterministic_algorithms(True, warn_only=True)  # the resumed step against the uninterrupted one
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    # grpokit runs one process unsharded (run_options warns and returns None): ask as if there were two, so that
    # this process shards for real over its one-process group (every parameter a DTensor, NCCL collectives).
    def as_if_two(args, processes, agentic, peft=False):
        return run_options(args, max(processes, 2), agentic, peft)

    import grpokit.train.learner as learner

    learner.run_options = as_if_two
    options = GRPOConfig(output_dir=out, max_steps=2, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=8, learning_rate=1e-2, beta=0.04, bf16=True,
                         fsdp="full_shard auto_wrap", save_strategy="steps", save_steps=1, seed=0, logging_steps=1,
                         disable_tqdm=True, report_to=[], log_completions=False)
    dataset = datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)])
    trainer = GRPOTrainer(model_dir, [short], options, dataset)
    trainer.train(resume_from_checkpoint=True if resume else None)
    model = trainer.learner.model
    shard = next(iter(model.parameters()))
    results = {
        "backend": dist.get_backend(), "world_size": dist.get_world_size(), "sharded": isinstance(model, FSDPModule),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "device": (shard.to_local() if isinstance(shard, DTensor) else shard).device.type,
        "param_dtype": str(shard.dtype), "global_step": trainer.state.global_step,
    }
    print("RESULTS " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def run_fsdp_worker(model_dir: str, out: Path, resume: bool = False):
    from procs import run_tree

    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", __file__,
               "fsdp-worker", model_dir, str(out)] + (["--resume"] if resume else [])
    result = run_tree(command, 80, env=env)  # ~25 s on a GPU; gpu_check.sh gives all the tests 180 s
    assert result.returncode == 0, result.stderr[-4000:]
    line = next((x for x in result.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, result.stdout[-2000:] + result.stderr[-2000:]
    return json.loads(line.removeprefix("RESULTS ")), result.stderr


def test_fsdp2_over_nccl_trains_sharded_and_resumes_its_dcp_checkpoint(tiny_model_dir, tmp_path):
    """test_fsdp2.py on the GPU, one process: FSDP2 over NCCL (every parameter a DTensor on the GPU), two bf16
    steps, a sharded checkpoint after each; a fresh process resumes from checkpoint-1 and its step 2 repeats the
    uninterrupted one (metrics to 1e-3; weights equal but for a few entries that nondeterministic GPU kernels may
    flip: a lost optimizer state, weights or data position would move most entries by ~lr = 1e-2)."""
    from safetensors.torch import load_file

    from grpokit.train.distcp import saved_keys
    from helpers import read_jsonl

    first = tmp_path / "first"
    found, _ = run_fsdp_worker(tiny_model_dir, first)
    assert found == {"backend": "nccl" if ON_GPU else "gloo", "world_size": 1, "sharded": True, "dtensors": True,
                     "device": DEVICE.type, "param_dtype": "torch.float32", "global_step": 2}
    for step in (1, 2):
        checkpoint = first / f"checkpoint-{step}"
        assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [".metadata", "__0_0.distcp"]
        assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
        assert json.loads((checkpoint / "trainer_state.json").read_text())["num_processes"] == 1
    assert {"model.model.embed_tokens.weight", "optimizer.state.model.embed_tokens.weight.exp_avg"} <= \
        saved_keys(first / "checkpoint-1")
    rows = read_jsonl(first / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.symlink(first / "checkpoint-1", resumed / "checkpoint-1")
    found, log = run_fsdp_worker(tiny_model_dir, resumed, resume=True)
    assert found["sharded"] and found["global_step"] == 2
    assert re.search(r"Resumed from \S*checkpoint-1 at step 1\.", log), log[-3000:]
    (again,) = read_jsonl(resumed / "metrics.jsonl")
    assert again["step"] == 2
    for key in ("loss", "kl", "grad_norm", "reward"):
        assert again[key] == pytest.approx(rows[1][key], rel=1e-3, abs=1e-6), key
    final, expected = load_file(resumed / "model.safetensors"), load_file(first / "model.safetensors")
    assert final.keys() == expected.keys()
    flipped = sum(int(((final[k] - expected[k]).abs() > 1e-5).sum()) for k in expected)
    total = sum(t.numel() for t in expected.values())
    worst = max((final[k] - expected[k]).abs().max().item() for k in expected)
    assert flipped <= 1e-3 * total and worst <= 2.5e-2, f"{flipped} of {total} entries differ, the largest by {worst}"


# ---------------------------------------------------------------------------- the in-place gradients decision
def test_gradients_are_not_summed_in_place_on_cuda(tiny_model_dir):
    """grpokit.train.in_place.in_place_gradients: summing into .grad is off on CUDA, and says why."""
    if importlib.util.find_spec("grpokit.train.in_place") is None:
        pytest.skip("grpokit.train.in_place does not exist yet (in_place_gradients is being added)")
    if not ON_GPU:
        pytest.skip("the decision for a CUDA model needs a CUDA device")
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from grpokit.train.in_place import in_place_gradients

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).to(DEVICE)
    decision = in_place_gradients(model, Accelerator(), sharded=False, device=torch.device("cuda"))
    assert decision.enabled is False
    assert isinstance(decision.reason, str) and decision.reason.strip()
    assert re.search(r"cuda|gpu", decision.reason, re.IGNORECASE), decision.reason


if __name__ == "__main__":
    if sys.argv[1:2] != ["fsdp-worker"]:
        sys.exit("usage: test_cuda.py fsdp-worker MODEL_DIR OUT [--resume]  (pytest runs the tests)")
    fsdp_worker(sys.argv[2], sys.argv[3], "--resume" in sys.argv[4:])


@pytest.mark.parametrize("upstream", [1.0, 2.5])  # handed over as they are; scaled in place on the device
def test_the_fused_heads_backwards_make_no_host_sync(upstream):
    """The backwards a training step runs on a GPU read nothing back to the host (no `.item()`, no `bool(tensor)`):
    torch.cuda's sync debug mode "error" turns any synchronising call into an error. head_token_loss's backward
    hands over (or scales in place) the gradients its forward computed; head_logprobs' recomputes its chunks."""
    if not ON_GPU:
        pytest.skip("the sync debug mode is CUDA's")
    from grpokit.algorithms import head_logprobs, head_token_loss

    leaves, targets, g_logp, _ = head_inputs(39, VOCAB, WIDTH, True, "autocast", seed=5)
    hidden, weight, b = leaves
    with autocast("autocast"):
        loss, _, _ = head_token_loss(hidden, weight, b, targets, lambda x, e, part: (x * g_logp[part]).sum(), 0.7,
                                     with_entropy=True, chunk_elements=5 * VOCAB, entropy_grad=False)
        logp, _ = head_logprobs(hidden, weight, b, targets, 0.7, chunk_elements=5 * VOCAB)
    second = (logp * g_logp).sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        (upstream * loss).backward()
        (upstream * second).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(t.grad).all() for t in leaves)

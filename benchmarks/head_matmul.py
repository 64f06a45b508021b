"""fp32 (and bf16) matmul rates of the LM head's products at the `real` workload's shapes, on this machine.

    python benchmarks/head_matmul.py [--threads 2]

The head products of a GRPO step at the real vocabulary (V = 151,936, H = 256): the 16-row decode product
(generation), the (C, V) logits of a chunk (every pass), and the backward's dL/dh = dL/dz W and dL/dW = dL/dz^T h.
Their rates bound how fast any exact trainer can run a step here (benchmarks/README.md). Then the fused head's
dL/dW under bf16 autocast two ways, a no-grad head pass at the default and the no-grad chunk sizes, and exp over
exponents below the head's EXP_FLOOR. Not part of the suite.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

V, H = 151_936, 256


def best_seconds(fn, repeats: int = 5) -> float:
    """fn's best wall time of `repeats` calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def rate(fn, flops: float, repeats: int = 5) -> float:
    """GFLOP/s of fn, best of `repeats` after one warm-up call."""
    return flops / best_seconds(fn, repeats) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weight = torch.randn(V, H)
    head_t = weight.t().contiguous()  # the decode loop's layout (rollout/lean_decode.py)
    print(f"threads {args.threads}; GFLOP/s (best of 5)")
    decode = torch.randn(16, H)
    print(f"decode, 16 rows x (H, V):      {rate(lambda: decode @ head_t, 2 * 16 * V * H):6.1f}")
    for rows in (110, 1024):
        h, dz = torch.randn(rows, H), torch.randn(rows, V)
        flops = 2 * rows * V * H
        print(f"logits z = h W^T, {rows:4d} rows:  {rate(lambda: h @ weight.t(), flops):6.1f}")
        print(f"dL/dh = dz W, {rows:4d} rows:      {rate(lambda: dz @ weight, flops):6.1f}")
        print(f"dL/dW = dz^T h, {rows:4d} rows:    {rate(lambda: dz.t() @ h, flops):6.1f}")
    h16, w16 = torch.randn(1024, H).bfloat16(), weight.bfloat16()
    print(f"bf16 logits, 1024 rows:        {rate(lambda: h16 @ w16.t(), 2 * 1024 * V * H):6.1f}")
    # The fused head's dL/dW under bf16 autocast, a 110-row chunk summed into an fp32 (V, H) gradient: the bf16
    # product writes a (V, H) bf16 temporary the sum then reads; the fp32 addmm_ sums in place (fused_head.py).
    rows = 110
    h, dz = torch.randn(rows, H), torch.randn(rows, V)
    h_low, dz_low, grad = h.bfloat16(), dz.bfloat16(), torch.zeros(V, H)
    flops = 2 * rows * V * H
    print(f"dL/dW bf16 product + fp32 sum, {rows} rows: {rate(lambda: grad.add_(dz_low.t() @ h_low), flops):6.1f}")
    print(f"dL/dW fp32 addmm_ into the sum, {rows} rows: {rate(lambda: grad.addmm_(dz.t(), h), flops):6.1f}")
    no_grad_passes(weight * 0.02)  # the random-init models' scale: logits a few nats wide
    exp_below_the_floor()


def exp_below_the_floor(rows: int = 110) -> None:
    """exp_ over one chunk of exponents spread down to -40 / -100 / -150, as is and clamped at the fused head's
    EXP_FLOOR first (below it exp returns denormals, slow on x86): milliseconds."""
    from grpokit.algorithms.fused_head import EXP_FLOOR

    out = torch.empty(rows, V)
    for low in (-40.0, -100.0, -150.0):
        source = torch.empty(rows, V).uniform_(low, 0.0)
        plain = best_seconds(lambda: out.copy_(source).exp_()) * 1e3
        clamped = best_seconds(lambda: out.copy_(source).clamp_(min=EXP_FLOOR).exp_()) * 1e3
        print(f"exp_ of a {rows}-row chunk in [{low:.0f}, 0]: {plain:5.1f} ms, clamped first {clamped:5.1f} ms")


def no_grad_passes(weight: torch.Tensor, positions: int = 4096) -> None:
    """The fused head over a reference pass's positions, without gradients, at the default chunk and at the
    no-grad passes' (algorithms/logprobs.py NO_GRAD_CHUNK_ELEMENTS), in fp32 and under bf16 autocast: seconds."""
    from grpokit.algorithms import head_logprobs
    from grpokit.algorithms.logprobs import DEFAULT_CHUNK_ELEMENTS, NO_GRAD_CHUNK_ELEMENTS, chunk_rows

    hidden, targets = torch.randn(positions, H), torch.randint(0, V, (positions,))
    for low in (False, True):
        for elements in (DEFAULT_CHUNK_ELEMENTS, NO_GRAD_CHUNK_ELEMENTS):
            def run():
                with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
                    head_logprobs(hidden, weight, None, targets, 1.0, True, elements)
            seconds = best_seconds(run, repeats=3)
            print(f"no-grad head pass, {positions} positions, {'bf16' if low else 'fp32'}, "
                  f"{chunk_rows(V, elements)}-row chunks: {seconds:5.2f} s")


if __name__ == "__main__":
    main()

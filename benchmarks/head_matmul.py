"""fp32 (and bf16) matmul rates of the LM head's products at the `real` workload's shapes, on this machine.

    python benchmarks/head_matmul.py [--threads 2]

The head products of a GRPO step at the real vocabulary (V = 151,936, H = 256): the 16-row decode product
(generation), the (C, V) logits of a chunk (every pass), and the backward's dL/dh = dL/dz W and dL/dW = dL/dz^T h.
Their rates bound how fast any exact trainer can run a step here (benchmarks/README.md). Not part of the suite.
"""

from __future__ import annotations

import argparse
import time

import torch

V, H = 151_936, 256


def rate(fn, flops: float, repeats: int = 5) -> float:
    """GFLOP/s of fn, best of `repeats` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return flops / best / 1e9


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


if __name__ == "__main__":
    main()

"""Generation alone at the real vocabulary: grpokit's rollout against transformers' generate, same run.

    python benchmarks/generation.py [--length 64] [--rows 16] [--repeats 3]

The `real` workload's model (43M parameters, vocab 151,936), 2 prompts x 8 rows, every row forced to `--length`
new tokens; transformers samples with do_sample=True (its own RNG), grpokit with its counter-based sampler. Prints
the best of `--repeats` for each, and grpokit's decode step split into the head matmul and the sampler.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from grpokit.rollout.generate import SamplingParams, generate_completions, left_pad  # noqa: E402
from grpokit.rollout.lean_decode import last_position_logits  # noqa: E402
from grpokit.rollout.sampling import hashed_uniform, inverse_cdf_sample  # noqa: E402
from grpokit.tiny import tiny_qwen2  # noqa: E402
from workloads import REAL, prompts, tokenizer_for  # noqa: E402


def best_of(repeats: int, fn) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tok = tokenizer_for("real")
    model = tiny_qwen2(len(tok), hidden_size=REAL.hidden_size, num_layers=REAL.num_layers, seed=0,
                       max_position_embeddings=2048).eval()
    distinct = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts("real")[:2]]
    rows = [p for p in distinct for _ in range(args.rows // 2)]
    params = SamplingParams(args.length, generation_kwargs={"min_new_tokens": args.length})

    def ours():
        generate_completions(model, tok, rows, torch.arange(len(rows)), params, seed=0)

    ids, mask = left_pad(rows, tok.pad_token_id)

    @torch.no_grad()
    def transformers_generate():
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=args.length,
                       min_new_tokens=args.length, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    hidden = torch.randn(len(rows), REAL.hidden_size)
    head_t = model.lm_head.weight.detach().t().contiguous()
    logits = model.lm_head(hidden).detach()
    head = best_of(20, lambda: last_position_logits(hidden, head_t))
    sampler = best_of(20, lambda: inverse_cdf_sample(logits, hashed_uniform(0, torch.arange(len(rows)), 3)))
    print(f"{len(rows)} rows x {args.length} tokens, vocab {len(tok)}, {torch.get_num_threads()} threads")
    print(f"grpokit rollout: {best_of(args.repeats, ours):.2f} s (per step: head matmul {1e3 * head:.1f} ms, "
          f"sampler {1e3 * sampler:.1f} ms)")
    print(f"transformers generate: {best_of(args.repeats, transformers_generate):.2f} s")


if __name__ == "__main__":
    main()

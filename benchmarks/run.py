"""grpokit against TRL's GRPOTrainer on CPU, one command:

    python benchmarks/run.py --workload small|large|all [--repeats 2] [--check-math]

Runs alternate (grpokit, trl, trl-defaults, grpokit, ...), each in a fresh subprocess, so peak RSS is per run.
Warm-up steps are discarded; seconds per step is the median of the remaining steps of all runs of an engine, in
wall-clock and in process CPU seconds (the latter is steadier on a machine shared with other work). MFU divides
the workload's model FLOPs per second by the best fp32 matmul rate measured inside the same run (with all its
threads); "MFU (CPU time)" uses CPU seconds per step and the per-thread peak instead.
Engines: `grpokit`; `trl` like-for-like (no gradient checkpointing, no KL bias correction, same loss_type dapo,
scale_rewards group, beta, lr, batch and lengths); `trl-defaults` (TRL's defaults for everything the workload does
not fix: gradient checkpointing on, use_bias_correction_kl on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from grpokit.tiny import char_tokenizer  # noqa: E402
from workloads import (  # noqa: E402
    COMPLETION_LENGTH, COMPLETIONS_PER_STEP, WORKLOADS, build_model_dir, prompts, workload_flops,
)

ENGINES = ("grpokit", "trl", "trl-defaults")


def run_alternating(workload: str, model_dir: Path, repeats: int, engines: list[str], results: Path) -> list[dict]:
    rows = []
    for _ in range(repeats):
        for engine in engines:
            before = results.read_text().count("\n") if results.exists() else 0
            subprocess.run([sys.executable, str(HERE / "worker.py"), engine, str(model_dir), workload, str(results)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            rows.append(json.loads(results.read_text().splitlines()[before]))
            print(f"  {workload} {engine}: wall {[round(d, 2) for d in rows[-1]['durations']]} s, "
                  f"cpu {[round(d, 2) for d in rows[-1]['cpu_seconds']]} s", flush=True)
    return rows


def summarise(rows: list[dict], flops_per_step: float) -> dict[str, dict]:
    out = {}
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine]
        measured = [d for r in mine for d in r["durations"][r["warmup"]:]]
        cpu = [d for r in mine for d in r["cpu_seconds"][r["warmup"]:]]
        seconds = statistics.median(measured)
        peak = statistics.median(r["matmul_peak_flops"] for r in mine)
        out[engine] = {
            "seconds_per_step": seconds,
            "cpu_seconds_per_step": statistics.median(cpu),
            "tokens_per_second": COMPLETIONS_PER_STEP * COMPLETION_LENGTH / seconds,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
            "mfu": flops_per_step / seconds / peak,
            "mfu_cpu_time": flops_per_step / statistics.median(cpu) / peak / mine[0]["threads"],
            "matmul_peak_gflops": peak / 1e9,
            "steps_measured": len(measured),
        }
    return out


def table(workload: str, params: int, summary: dict[str, dict]) -> str:
    base = summary["grpokit"]["seconds_per_step"] if "grpokit" in summary else None
    lines = [f"workload {workload} ({params / 1e6:.1f}M params)",
             "| engine | s/step | CPU s/step | generated tok/s | peak RSS MiB | matmul peak GFLOP/s | MFU (wall) "
             "| MFU (CPU time) | speed-up of grpokit (s/step, CPU s/step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine, s in summary.items():
        ratio = "-"
        if base and engine != "grpokit":
            ratio = (f"{s['seconds_per_step'] / base:.2f}x, "
                     f"{s['cpu_seconds_per_step'] / summary['grpokit']['cpu_seconds_per_step']:.2f}x")
        lines.append(f"| {engine} | {s['seconds_per_step']:.3f} | {s['cpu_seconds_per_step']:.3f} | "
                     f"{s['tokens_per_second']:.0f} | {s['peak_rss_mib']:.0f} | {s['matmul_peak_gflops']:.1f} | "
                     f"{100 * s['mfu']:.1f}% | {100 * s['mfu_cpu_time']:.1f}% | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="small")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine, alternating")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--check-math", action="store_true", help="only compare loss and gradients with TRL")
    parser.add_argument("--threads", type=int, help="torch threads in every run (default: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    if args.check_math:
        from check_math import check_math

        for row in check_math():
            print(json.dumps(row))
        return
    if args.threads:
        os.environ["BENCH_THREADS"] = str(args.threads)
    prompt_tokens = max(len(char_tokenizer()(p)["input_ids"]) for p in prompts())
    report = {"threads": args.threads or torch.get_num_threads(), "workloads": {}}
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    with tempfile.TemporaryDirectory() as folder:
        for name in names:
            model_dir = Path(folder) / name
            params = build_model_dir(WORKLOADS[name], model_dir)
            rows = run_alternating(name, model_dir, args.repeats, args.engines.split(","), Path(folder) / "runs.jsonl")
            flops = workload_flops(params, prompt_tokens, COMPLETION_LENGTH, COMPLETIONS_PER_STEP)
            summary = summarise(rows, flops)
            report["workloads"][name] = {"params": params, "summary": summary, "runs": rows}
            print(table(name, params, summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

"""grpokit against TRL's GRPOTrainer, one command:

    python benchmarks/run.py --workload small|large|real|all [--repeats 2] [--check-math]
    python benchmarks/run.py --growth              # real vocabulary: completion length x G, time and peak RSS
    python benchmarks/run.py --workload spread --engines grpokit,grpokit-padded,trl   # real length spreads
    python benchmarks/run.py --workload multiturn --engines grpokit,grpokit-padded,trl   # multi-turn transcripts
    python benchmarks/run.py --spread-growth --engines grpokit,grpokit-budget4096   # caps 512 / 1024 / 2048: RSS

Runs alternate (grpokit, trl, trl-defaults, grpokit, ...), each in a fresh subprocess, so peak RSS is per run.
Warm-up steps are discarded; seconds per step is the median of the remaining steps of all runs of an engine, in
wall-clock and in process CPU seconds (the latter is steadier on a machine shared with other work). MFU divides
the workload's model FLOPs per second by the best fp32 matmul rate measured inside the same run (with all its
threads); "MFU (CPU time)" uses CPU seconds per step and the per-thread peak instead.
Engines: `grpokit` (its local rollout engine); `grpokit@PATH`, the same from the grpokit checkout at PATH (its own
benchmarks/worker.py and package: an old commit against this one in the same run, e.g. after a refactor, with
`git worktree add /tmp/old <commit>`); `grpokit-vllm` (use_vllm=True, colocate; needs the vllm extra);
`grpokit-padded` (padding_free=False: the padded passes, to see what packing gives); `grpokit-budget<N>`
(token_budget=N); `--token-budget N` gives every grpokit run token_budget=N; `trl` like-for-like (no gradient
checkpointing, no KL bias correction, same loss_type dapo, scale_rewards group, beta, lr, batch and lengths);
`trl-defaults` (TRL's defaults for everything the workload does not fix: gradient checkpointing on,
use_bias_correction_kl on).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from workloads import (  # noqa: E402
    GROWTH, SPREAD_GROWTH, WORKLOADS, ScriptedSpread, ScriptedTranscripts, build_model_dir, prompts, tokenizer_for,
    workload_flops,
)

ENGINES = ("grpokit", "trl", "trl-defaults")  # also: grpokit-vllm (needs the vllm extra)


def run_worker(engine: str, model_dir: Path, workload: str, results: Path, rss_limit_gib: float,
               timeout_s: float) -> dict:
    """One worker process, killed (with its children) when its resident memory passes rss_limit_gib or it runs
    past timeout_s; returns its result row, or a row that records the kill."""
    before = results.read_text().count("\n") if results.exists() else 0
    name, _, tree = engine.partition("@")  # grpokit@PATH: the worker of the checkout at PATH
    worker = Path(tree) / "benchmarks" / "worker.py" if tree else HERE / "worker.py"
    process = subprocess.Popen([sys.executable, str(worker), name, str(model_dir), workload, str(results)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    started, peak, killed = time.monotonic(), 0.0, None
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            peak = max(peak, watched.memory_info().rss / 2**30)
        except psutil.NoSuchProcess:
            break
        if peak > rss_limit_gib or time.monotonic() - started > timeout_s:
            killed = f"killed at {peak:.1f} GiB RSS" if peak > rss_limit_gib else f"killed after {timeout_s:.0f} s"
            os.killpg(process.pid, 9)
            break
        time.sleep(0.2)
    _, stderr = process.communicate(timeout=60)
    if killed or process.returncode:
        print(f"  {workload} {engine}: {killed or 'failed'}\n{stderr[-1500:] if not killed else ''}", flush=True)
        return {"engine": engine, "workload": workload, "failed": killed or f"exit {process.returncode}"}
    row = json.loads(results.read_text().splitlines()[before]) | {"engine": engine}
    print(f"  {workload} {engine}: wall {[round(d, 2) for d in row['durations']]} s, "
          f"cpu {[round(d, 2) for d in row['cpu_seconds']]} s, peak RSS {row['peak_rss_mib']:.0f} MiB", flush=True)
    return row


def run_alternating(workload: str, model_dir: Path, repeats: int, engines: list[str], results: Path,
                    rss_limit_gib: float = 20.0, timeout_s: float = 3600.0) -> list[dict]:
    return [run_worker(engine, model_dir, workload, results, rss_limit_gib, timeout_s)
            for _ in range(repeats) for engine in engines]


def summarise(rows: list[dict], flops_per_step: float, completion_tokens: int) -> dict[str, dict]:
    out = {}
    for engine in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == engine and "failed" not in r]
        if not mine:
            out[engine] = {"failed": next(r["failed"] for r in rows if r["engine"] == engine)}
            continue
        measured = [d for r in mine for d in r["durations"][r["warmup"]:]]
        cpu = [d for r in mine for d in r["cpu_seconds"][r["warmup"]:]]
        seconds = statistics.median(measured)
        peak = statistics.median(r["matmul_peak_flops"] for r in mine)
        out[engine] = {
            "seconds_per_step": seconds,
            "cpu_seconds_per_step": statistics.median(cpu),
            "tokens_per_second": completion_tokens / seconds,
            "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
            "mfu": flops_per_step / seconds / peak,
            "mfu_cpu_time": flops_per_step / statistics.median(cpu) / peak / mine[0]["threads"],
            "matmul_peak_gflops": peak / 1e9,
            "steps_measured": len(measured),
        }
    return out


def table(workload: str, params: int, summary: dict[str, dict]) -> str:
    base = summary.get("grpokit", {}).get("seconds_per_step")
    lines = [f"workload {workload} ({params / 1e6:.1f}M params)",
             "| engine | s/step | CPU s/step | generated tok/s | peak RSS MiB | matmul peak GFLOP/s | MFU (wall) "
             "| MFU (CPU time) | speed-up of grpokit (s/step, CPU s/step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for engine, s in summary.items():
        if "failed" in s:
            lines.append(f"| {engine} | {s['failed']} | | | | | | | |")
            continue
        ratio = "-"
        if base and engine != "grpokit" and "failed" not in summary["grpokit"]:
            ratio = (f"{s['seconds_per_step'] / base:.2f}x, "
                     f"{s['cpu_seconds_per_step'] / summary['grpokit']['cpu_seconds_per_step']:.2f}x")
        lines.append(f"| {engine} | {s['seconds_per_step']:.3f} | {s['cpu_seconds_per_step']:.3f} | "
                     f"{s['tokens_per_second']:.0f} | {s['peak_rss_mib']:.0f} | {s['matmul_peak_gflops']:.1f} | "
                     f"{100 * s['mfu']:.1f}% | {100 * s['mfu_cpu_time']:.1f}% | {ratio} |")
    return "\n".join(lines)


def growth_table(summaries: dict[str, dict]) -> str:
    lines = ["| completion length | G | completions/step | grpokit s/step | TRL s/step | speed-up | grpokit peak RSS MiB "
             "| TRL peak RSS MiB | RSS ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for name, summary in summaries.items():
        w, ours, trl = WORKLOADS[name], summary.get("grpokit", {}), summary.get("trl", {})

        def cell(s: dict, key: str, fmt: str) -> str:
            return format(s[key], fmt) if key in s else s.get("failed", "-")

        both = "seconds_per_step" in ours and "seconds_per_step" in trl
        speed = f"{trl['seconds_per_step'] / ours['seconds_per_step']:.2f}x" if both else "-"
        memory = f"{ours['peak_rss_mib'] / trl['peak_rss_mib']:.2f}" if both else "-"
        lines.append(
            f"| {w.completion_length} | {w.num_generations} | {w.completions_per_step} | "
            f"{cell(ours, 'seconds_per_step', '.1f')} | {cell(trl, 'seconds_per_step', '.1f')} | {speed} | "
            f"{cell(ours, 'peak_rss_mib', '.0f')} | {cell(trl, 'peak_rss_mib', '.0f')} | {memory} |"
        )
    return "\n".join(lines)


def engines_table(summaries: dict[str, dict]) -> str:
    """One row per workload (the spread growth: its completion cap), s/step and peak RSS of each engine."""
    engines = list(dict.fromkeys(e for summary in summaries.values() for e in summary))
    head = " | ".join(f"{e} s/step | {e} peak RSS MiB" for e in engines)
    lines = [f"| workload | completion cap | {head} |", "|---|---|" + "---|" * (2 * len(engines))]
    for name, summary in summaries.items():
        cells = []
        for e in engines:
            s = summary.get(e, {})
            cells += [f"{s['seconds_per_step']:.1f}", f"{s['peak_rss_mib']:.0f}"] if "seconds_per_step" in s else \
                [s.get("failed", "-"), ""]
        lines.append(f"| {name} | {WORKLOADS[name].completion_length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="small")
    parser.add_argument("--growth", action="store_true",
                        help="the real-vocabulary growth table (grpokit, trl; add --workload real for its middle row)")
    parser.add_argument("--spread-growth", action="store_true",
                        help="the spread workload at completion caps 512, 1024, 2048 (grpokit, trl): time, peak RSS")
    parser.add_argument("--token-budget", type=int, help="token_budget for every grpokit run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each engine, alternating")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--check-math", action="store_true", help="only compare loss and gradients with TRL")
    parser.add_argument("--threads", type=int, help="torch threads in every run (default: torch's default)")
    parser.add_argument("--bf16", action="store_true", help="both trainers with bf16=True")
    parser.add_argument("--rss-limit-gib", type=float, default=20.0, help="kill a run whose RSS passes this")
    parser.add_argument("--timeout", type=float, default=3600.0, help="kill a run that takes longer (seconds)")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    if args.check_math:
        from check_math import check_math

        for row in check_math():
            print(json.dumps(row))
        return
    if args.threads:
        os.environ["BENCH_THREADS"] = str(args.threads)
    if args.bf16:
        os.environ["BENCH_BF16"] = "1"
    if args.token_budget:
        os.environ["BENCH_TOKEN_BUDGET"] = str(args.token_budget)
    report = {"threads": args.threads or torch.get_num_threads(), "bf16": args.bf16, "workloads": {},
              "token_budget": args.token_budget}
    if args.growth:
        names, engines, repeats = GROWTH + (["real"] if args.workload == "real" else []), ["grpokit", "trl"], 1
    elif args.spread_growth:
        names, engines, repeats = SPREAD_GROWTH, args.engines.split(","), 1
    else:
        names = ["small", "large", "real"] if args.workload == "all" else [args.workload]
        engines, repeats = args.engines.split(","), args.repeats
    with tempfile.TemporaryDirectory() as folder:
        model_dirs: dict[tuple, tuple[Path, int]] = {}
        for name in names:
            w = WORKLOADS[name]
            if w.model_key not in model_dirs:
                path = Path(folder) / f"model-{len(model_dirs)}"
                model_dirs[w.model_key] = (path, build_model_dir(w, path))
            model_dir, params = model_dirs[w.model_key]
            rows = run_alternating(name, model_dir, repeats, engines, Path(folder) / "runs.jsonl",
                                   args.rss_limit_gib, args.timeout)
            tok = tokenizer_for(w.vocab)
            encoded = [tok(p, add_special_tokens=False)["input_ids"]
                       for p in prompts(w.vocab, spread=w.spread or w.multiturn)]
            prompt_tokens = max(len(ids) for ids in encoded)
            completion_tokens = w.completion_length
            if w.spread or w.multiturn:  # the means over the prompt set (the steps draw from it)
                prompt_tokens = sum(len(ids) for ids in encoded) / len(encoded)
                script = (ScriptedSpread if w.spread else ScriptedTranscripts)(tok, w.completion_length)
                drawn = script([ids for ids in encoded for _ in range(w.num_generations)])
                drawn = drawn if w.spread else [t for t, _, _ in drawn]
                completion_tokens = sum(len(t) for t in drawn) / len(drawn)
            flops = workload_flops(params, prompt_tokens, completion_tokens, w.completions_per_step)
            summary = summarise(rows, flops, w.completions_per_step * completion_tokens)
            report["workloads"][name] = {"params": params, "summary": summary, "runs": rows}
            print(table(name, params, summary), flush=True)
    if args.growth:
        print(growth_table({n: report["workloads"][n]["summary"] for n in names}))
    if args.spread_growth:
        print(engines_table({n: report["workloads"][n]["summary"] for n in names}))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

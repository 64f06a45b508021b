"""grpokit against TRL's GRPOTrainer on one GPU, in the same run: seconds per step, generated tokens per second and
peak GPU memory of each trainer.

    python benchmarks/gpu_bench.py                          # both trainers; needs CUDA
    python benchmarks/gpu_bench.py --engines grpokit        # one of them
    python benchmarks/gpu_bench.py --smoke                  # a tiny model and two short steps: the code path, on a CPU

The workload: a random-init model of Qwen2.5-0.5B's shape built here from its config (no hub): Qwen2, hidden 896,
24 layers, 14 attention heads, 2 key-value heads, intermediate 4864, a 151,936-entry vocabulary (workloads.py's
word tokenizer, so every sampled id decodes), tied embeddings; saved in fp32 and trained with bf16=True (autocast)
by both trainers. 2 prompts of 16 tokens a step, G = 8 completions each, every completion exactly 512 tokens
(`min_new_tokens`, as the CPU workloads force theirs); 1 warm-up step, then 2 measured. TRL generates with
transformers' `generate` (no vLLM on that machine); grpokit with its local engine.

It reuses the CPU benchmark's machinery rather than a second harness: worker.py's `run_grpokit` and `run_trl`
(the same options for both trainers: `common_options`, like-for-like TRL settings), workloads.py's tokenizer,
prompts and reward, and run.py's `summarise` (median of the measured steps, completion tokens per second, MFU).
Each trainer runs in a fresh process (its own CUDA context: `torch.cuda.max_memory_allocated` is its own), grpokit
first, within --budget seconds in all (the later trainer gets what the earlier one left); a trainer stopped by the
budget reports the steps it finished. On a GPU, worker.py's step clock is wrapped to synchronise the device first,
so each step's time includes its queued kernels, and TRL's `use_cpu=True` (worker.py's CPU setting) is turned off.
TRL is not installed on the lent GPU machine: it comes as a wheel (benchmarks/README.md, "GPU check"); where it
cannot be imported, grpokit's figures still print and TRL's row says why.

MFU: the workload's model FLOPs per step (workloads.workload_flops: 10 x params x tokens) per second, over the
bf16 matmul rate measured on the same GPU in the same run (8192^3 products, the best of 10).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from workloads import Workload, prompts, tokenizer_for, workload_flops  # noqa: E402

# Qwen2.5-0.5B's shape (its config.json), random weights
QWEN25_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True)
WORKLOAD = Workload("qwen2.5-0.5b-shape", hidden_size=896, num_layers=24, warmup_steps=1, measured_steps=2,
                    vocab="real", completion_length=512, num_generations=8)
SMOKE = replace(WORKLOAD, name="smoke", hidden_size=64, num_layers=2, vocab="char", completion_length=16,
                num_generations=4, measured_steps=1)
SMOKE_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, max_position_embeddings=512, tie_word_embeddings=True)
ENGINES = ("grpokit", "trl")
RESERVE_S = 60.0  # budget kept back for each trainer still to run


def build_model_dir(folder: Path, smoke: bool, device: torch.device) -> int:
    """Save the random-init model and its tokenizer into `folder` (fp32); returns the parameter count."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    workload = SMOKE if smoke else WORKLOAD
    tok = tokenizer_for(workload.vocab)
    config = Qwen2Config(vocab_size=len(tok), pad_token_id=0, eos_token_id=1, bos_token_id=1,
                         **(SMOKE_SHAPE if smoke else QWEN25_05B))
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it will run: seconds on a GPU, not a minute on the CPU
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return params


def bf16_matmul_peak(size: int = 8192, repeats: int = 10) -> float:
    """bf16 FLOP/s of a size^3 matmul on the GPU, best of `repeats` (CUDA events)."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * size**3 / best


# ---------------------------------------------------------------------------- one trainer, in its own process
@contextlib.contextmanager
def trl_on(cuda: bool):
    """worker.run_trl builds TRL's GRPOConfig with use_cpu=True (the CPU benchmark's setting): on a GPU, False."""
    import trl

    original = trl.GRPOConfig

    def config(*args, **kwargs):
        kwargs["use_cpu"] = not cuda
        return original(*args, **kwargs)

    trl.GRPOConfig = config
    try:
        yield
    finally:
        trl.GRPOConfig = original


def run_one(engine: str, model_dir: str, progress: str, smoke: bool) -> None:
    """Train `engine` on the workload; every step end (and the start) appends a JSON line to `progress`: the
    clocks and the peak memory so far. worker.py's clock is wrapped, so both trainers' own step hooks write it."""
    import warnings

    os.environ["BENCH_BF16"] = "1"
    warnings.filterwarnings("ignore")
    import worker

    cuda = torch.cuda.is_available()
    workload = SMOKE if smoke else WORKLOAD
    clock = worker._clock

    def synchronised_clock():
        if cuda:
            torch.cuda.synchronize()  # the step's queued kernels belong to the step
        now = clock()
        mark = {"wall": now[0], "cpu": now[1], "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        if cuda:
            mark.update(allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
                        reserved_mib=torch.cuda.max_memory_reserved() / 2**20)
        with open(progress, "a") as f:
            f.write(json.dumps(mark) + "\n")
        return now

    worker._clock = synchronised_clock
    tokenizer_for(workload.vocab)  # built before the clock starts, as worker.main does
    steps = workload.warmup_steps + workload.measured_steps
    with tempfile.TemporaryDirectory() as out_dir:
        if engine == "grpokit":
            worker.run_grpokit(model_dir, workload, steps, out_dir)
        else:
            with trl_on(cuda):
                worker.run_trl(model_dir, workload, steps, out_dir, defaults=False)


# ---------------------------------------------------------------------------- the parent
def launch(engine: str, model_dir: Path, folder: Path, smoke: bool, timeout: float) -> dict:
    """Run one trainer in a fresh process for at most `timeout` s; its row (run.summarise's fields, and the peak
    GPU memory), from the steps it finished."""
    progress, log = folder / f"{engine}.progress.jsonl", folder / f"{engine}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", engine, str(model_dir), str(progress)]
    if smoke:
        command.append("--smoke")
    started, limit = time.monotonic(), max(timeout, 1.0)
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code, stopped = process.wait(timeout=limit), None
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code, stopped = None, f"stopped by the budget after {limit:.0f} s"
    seconds = time.monotonic() - started
    marks = []
    for line in progress.read_text().splitlines() if progress.exists() else []:
        try:
            marks.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by the kill
            break
    workload = SMOKE if smoke else WORKLOAD
    planned = workload.warmup_steps + workload.measured_steps
    row = {"engine": engine, "process_seconds": seconds, "planned_steps": planned,
           "durations": [b["wall"] - a["wall"] for a, b in zip(marks, marks[1:])],
           "cpu_seconds": [b["cpu"] - a["cpu"] for a, b in zip(marks, marks[1:])],
           "warmup": workload.warmup_steps, "threads": 1,
           "peak_rss_mib": marks[-1]["rss_mib"] if marks else None,
           "peak_allocated_mib": marks[-1].get("allocated_mib") if marks else None,
           "peak_reserved_mib": marks[-1].get("reserved_mib") if marks else None}
    measured = len(row["durations"]) - workload.warmup_steps
    if code not in (0, None) or measured < 1:
        tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-12:]
        why = stopped or f"exit {code}"
        row["failed"] = f"{why}, {max(measured, 0)} measured steps" + (": " + tail[-1][:300] if tail and code else "")
        row["log_tail"] = tail
    elif stopped:
        row["note"] = f"{stopped}: {measured} of {workload.measured_steps} measured steps"
    return row


def trl_missing() -> str | None:
    """Why TRL cannot run here, or None."""
    if importlib.util.find_spec("trl") is None:
        return ("trl is not installed on this machine: carry benchmarks/wheels (benchmarks/README.md, 'GPU check') "
                "and install them with benchmarks/gpu_check.sh")
    return None


def table(summary: dict, rows: list[dict], peak_flops: float, cuda: bool) -> str:
    head = ("| trainer | s/step (median) | generated tok/s | peak GPU memory allocated MiB | reserved MiB | MFU | "
            "steps timed |" if cuda else
            "| trainer | s/step (median) | generated tok/s | peak RSS MiB | | MFU (fp32 CPU peak) | steps timed |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for row in rows:
        engine, s = row["engine"], summary.get(row["engine"], {})
        if "failed" in row:
            lines.append(f"| {engine} | not measured: {row['failed']} | | | | | |")
            continue
        memory = (f"{row['peak_allocated_mib']:,.0f} | {row['peak_reserved_mib']:,.0f}" if cuda
                  else f"{row['peak_rss_mib']:,.0f} | ")
        steps = ", ".join(f"{d:.2f}" for d in row["durations"])
        lines.append(f"| {engine} | {s['seconds_per_step']:.2f} | {s['tokens_per_second']:,.0f} | {memory} | "
                     f"{100 * s['mfu']:.1f}% | {steps} (warm-up first){' ' + row['note'] if 'note' in row else ''} |")
    ours, trl = summary.get("grpokit", {}), summary.get("trl", {})
    if "seconds_per_step" in ours and "seconds_per_step" in trl:
        key = "peak_allocated_mib" if cuda else "peak_rss_mib"
        by = {r["engine"]: r for r in rows}
        lines.append(f"\ngrpokit: {trl['seconds_per_step'] / ours['seconds_per_step']:.2f}x TRL's speed "
                     f"(s/step), {by['grpokit'][key] / by['trl'][key]:.2f}x its peak "
                     f"{'GPU memory' if cuda else 'RSS'}; matmul peak {peak_flops / 1e12:.2f} TFLOP/s "
                     f"({'bf16, 8192^3' if cuda else 'fp32, CPU'})")
    return "\n".join(lines)


def versions() -> str:
    found = {}
    for name in ("torch", "transformers", "accelerate", "trl", "datasets"):
        try:
            from importlib.metadata import version

            found[name] = version(name)
        except Exception:  # noqa: BLE001 - any failure: not there
            found[name] = "missing"
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return f"{device}; " + ", ".join(f"{k} {v}" for k, v in found.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 16-token completions (CPU or GPU)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--budget", type=float, default=220.0, help="seconds for the trainers' runs in all")
    parser.add_argument("--json", type=Path, help="also write the rows and the summary here")
    parser.add_argument("--worker", nargs=3, metavar=("ENGINE", "MODEL_DIR", "PROGRESS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_one(*args.worker, smoke=args.smoke)
        return 0
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("gpu_bench: no CUDA device here (torch.cuda.is_available() is False); `--smoke` runs the same code "
              "path with a tiny model on the CPU", flush=True)
        return 2
    deadline = time.monotonic() + args.budget
    workload = SMOKE if args.smoke else WORKLOAD
    engines = [e for e in args.engines.split(",") if e]
    print(f"gpu_bench: {versions()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        started = time.monotonic()
        params = build_model_dir(folder / "model", args.smoke, torch.device("cuda" if cuda else "cpu"))
        print(f"gpu_bench: model {params / 1e6:.1f}M parameters ({workload.name}) built and saved in "
              f"{time.monotonic() - started:.1f} s; {workload.completions_per_step} completions of "
              f"{workload.completion_length} tokens a step, {workload.warmup_steps} warm-up + "
              f"{workload.measured_steps} measured steps, bf16", flush=True)
        if cuda:
            peak = bf16_matmul_peak()
        else:
            from workloads import matmul_peak_flops

            peak = matmul_peak_flops()
        rows = []
        for index, engine in enumerate(engines):
            missing = trl_missing() if engine == "trl" else None
            if missing:
                rows.append({"engine": engine, "failed": missing})
                print(f"gpu_bench: {engine}: {missing}", flush=True)
                continue
            timeout = deadline - time.monotonic() - RESERVE_S * (len(engines) - index - 1)
            row = launch(engine, folder / "model", folder, args.smoke, timeout)
            rows.append(row)
            state = row.get("failed") or row.get("note") or "ok"
            print(f"gpu_bench: {engine}: {state}; steps {[round(d, 2) for d in row.get('durations', [])]} s, "
                  f"process {row['process_seconds']:.0f} s", flush=True)
            if "log_tail" in row:
                print("\n".join(f"    {line}" for line in row["log_tail"]), flush=True)
    tok = tokenizer_for(workload.vocab)
    prompt_tokens = max(len(tok(p, add_special_tokens=False)["input_ids"]) for p in prompts(workload.vocab))
    flops = workload_flops(params, prompt_tokens, workload.completion_length, workload.completions_per_step)
    from run import summarise

    good = [dict(r, matmul_peak_flops=peak) for r in rows if "failed" not in r]
    summary = summarise(good, flops, workload.completions_per_step * workload.completion_length) if good else {}
    print(f"\nworkload {workload.name}: {params / 1e6:.1f}M parameters, {workload.completions_per_step} x "
          f"{workload.completion_length} completion tokens a step ({prompt_tokens}-token prompts), bf16; "
          f"{versions()}")
    print(table(summary, rows, peak, cuda), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"workload": workload.name, "params": params, "cuda": cuda,
                                         "matmul_peak_flops": peak, "versions": versions(), "rows": rows,
                                         "summary": summary}, indent=1))
    return 0 if all("failed" not in r or r["engine"] == "trl" for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())

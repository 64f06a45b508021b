"""Asynchronous rollouts against synchronous ones, with a vLLM server, in the same run (benchmarks/README.md).

    python benchmarks/async_rollouts.py --workload real --steps 4 --repeats 2 --pin
    python benchmarks/async_rollouts.py --workload real --steps 4 --repeats 2          # both sides on every core

Starts `grpo vllm-serve` on the workload's model (fp32), then trains with max_staleness 0 (synchronous) and 1
(asynchronous), alternating, each run in its own process, with the same options as benchmarks/worker.py's grpokit
run (completions forced to the workload's length, KL to a reference, mismatch correction on). --pin gives the
server the last core and the trainer the others (taskset, VLLM_CPU_OMP_THREADS_BIND, torch threads), so that
generation and training do not compete for a core; without it both float over every core.

Per run it reports, over the measured steps (the first `--warmup` steps of each run are not counted): seconds per
optimizer step (median), and from metrics.jsonl the time the learner waited for batches, the time the producer
worked, and the overlap (time both sides were busy / step time). For the synchronous runs, generation_seconds
(engine call, rewards, push) is the generation side of each step, the rest is training. Every process started is
killed with its whole tree on a timeout or at exit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests"))

from procs import kill_tree, run_tree  # noqa: E402  (the test harness's: whole trees, sessions included)

TRAINER = r"""
import json, os, sys, warnings
sys.path.insert(0, {root!r}); sys.path.insert(0, {bench!r})
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads({threads})
from datasets import Dataset
from grpokit import GRPOConfig, GRPOTrainer
from worker import common_options
from workloads import WORKLOADS, count_vowels, prompts, tokenizer_for
workload = WORKLOADS[{workload!r}]
args = GRPOConfig(output_dir={out!r}, max_steps={steps}, gradient_checkpointing=False, save_strategy="no",
                  log_completions=False, disable_tqdm=True, logging_steps=1, report_to="none", use_vllm=True,
                  vllm_mode="server", vllm_server_host="127.0.0.1", vllm_server_port={port},
                  vllm_server_timeout=600.0, max_staleness={staleness}, **common_options(workload))
trainer = GRPOTrainer({model!r}, count_vowels, args, Dataset.from_dict({{"prompt": prompts(workload.vocab)}}),
                      processing_class=tokenizer_for(workload.vocab))
trainer.train()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, port: int, core: int | None, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "grpokit.cli", "vllm-serve", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-gib", "2"]
    env = dict(os.environ)
    if core is not None:
        command = ["taskset", "-c", str(core), *command]
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {server.returncode}; see its log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1.0)
    raise TimeoutError(f"the vLLM server did not answer /health within {timeout:.0f} s")


def train(model_dir: Path, workload: str, out: Path, port: int, staleness: int, steps: int, cores: str | None,
          threads: int, timeout: float) -> list[dict]:
    """One training run in its own process; its metrics rows."""
    code = TRAINER.format(root=str(ROOT), bench=str(Path(__file__).resolve().parent), threads=threads,
                          workload=workload, out=str(out), steps=steps, port=port, staleness=staleness,
                          model=str(model_dir))
    command = [sys.executable, "-c", code]
    if cores is not None:
        command = ["taskset", "-c", cores, *command]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    result = run_tree(command, timeout, env=env)  # a run past the timeout is killed with its whole tree
    if result.returncode != 0:
        raise RuntimeError(f"training run failed:\n{result.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def summarise(rows: list[dict], warmup: int) -> dict:
    measured = rows[warmup:]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in measured)  # noqa: E731
    step = statistics.median(r["step_seconds"] for r in measured)
    out = {"s_per_step": step, "steps": len(measured), "all_step_seconds": [r["step_seconds"] for r in measured]}
    if "async/overlap" in measured[0]:
        out.update(training_wait=mean("async/training_wait_seconds"), generation_busy=mean(
            "async/generation_busy_seconds"), generation_wait=mean("async/generation_wait_seconds"),
            overlap=mean("async/overlap"), staleness=max(r.get("async/staleness/max", 0.0) for r in measured))
    else:
        out.update(generation=mean("generation_seconds"), training=step - mean("generation_seconds"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="real")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each run not counted")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--pin", action="store_true", help="server on the last core, trainer on the others")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per training run before it is killed")
    parser.add_argument("--json", type=Path, help="also write the results here")
    cli = parser.parse_args()
    from workloads import WORKLOADS, build_model_dir

    cores = os.cpu_count() or 1
    server_core = cores - 1 if cli.pin else None
    trainer_cores = (f"0-{cores - 2}" if cores > 2 else "0") if cli.pin else None
    threads = max(1, cores - 1) if cli.pin else cores
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "model"
        params = build_model_dir(WORKLOADS[cli.workload], model_dir)
        port = free_port()
        server = start_server(model_dir, port, server_core, Path(folder) / "server.log")
        results: dict[str, list[dict]] = {"sync": [], "async": []}
        try:
            wait_healthy(port, server, 600)
            for repeat in range(cli.repeats):
                for mode, staleness in (("sync", 0), ("async", 1)):
                    out = Path(folder) / f"{mode}-{repeat}"
                    rows = train(model_dir, cli.workload, out, port, staleness, cli.steps, trainer_cores, threads,
                                 cli.timeout)
                    results[mode].append(summarise(rows, cli.warmup))
                    print(mode, repeat, json.dumps(results[mode][-1]), flush=True)
        except BaseException:
            print((Path(folder) / "server.log").read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            kill_tree(server.pid)
            server.wait(timeout=60)
    sync = statistics.median(r["s_per_step"] for r in results["sync"])
    ahead = statistics.median(r["s_per_step"] for r in results["async"])
    summary = {"workload": cli.workload, "params": params, "pinned": cli.pin, "cores": cores,
               "trainer_threads": threads, "sync_s_per_step": sync, "async_s_per_step": ahead,
               "speedup": sync / ahead, "runs": results, "date": time.strftime("%Y-%m-%d")}
    print(f"{cli.workload} ({params / 1e6:.1f}M params), {'pinned: server 1 core, trainer ' + trainer_cores if cli.pin else 'shared cores'}: "
          f"synchronous {sync:.2f} s/step, asynchronous {ahead:.2f} s/step: {sync / ahead:.2f}x")
    if cli.json:
        cli.json.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

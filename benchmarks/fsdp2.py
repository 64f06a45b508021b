"""FSDP2 against DDP on two CPU processes (gloo): per-process training state (parameters + gradients + AdamW
moments), peak RSS, and step time, on a Qwen2 at the real vocabulary (151,936 words).

    python benchmarks/fsdp2.py --hidden 512 --layers 8 --steps 3            # both, one after the other
    python benchmarks/fsdp2.py --mode fsdp ...                                # one of them

Each mode runs `torchrun --standalone --nproc_per_node 2 benchmarks/fsdp2.py --worker MODE` in its own process
tree; every worker prints one JSON line. The state is measured on the live tensors after training: each process's
local parameter bytes (a shard under FSDP), the gradients' bytes (the same shapes as the trainable parameters;
they are freed after each step, so they are counted from the parameters) and the optimizer state's local bytes.
Step time: the mean of the steps after the first (its generation and the warm-up of every kernel); timings on a
shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import count_vowels, prompts, tokenizer_for  # noqa: E402
from grpokit.tiny import tiny_qwen2  # noqa: E402


def local_bytes(tensor) -> int:
    """Bytes this process holds for `tensor` (its shard when it is a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(trainer) -> dict[str, int]:
    """Per-process bytes of parameters, gradients (counted as the trainable parameters) and optimizer state."""
    model, optimizer = trainer.learner.model, trainer.learner.optimizer
    params = sum(local_bytes(p) for p in model.parameters())
    grads = sum(local_bytes(p) for p in model.parameters() if p.requires_grad)
    moments = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    return {"params": params, "grads": grads, "optimizer": moments, "total": params + grads + moments}


_COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_single",
                "reduce_scatter_tensor", "all_reduce", "broadcast", "reduce", "barrier", "all_gather_object",
                "broadcast_object_list")


class Counters:
    """Per-process counts, bytes and seconds of every torch.distributed collective called from Python (FSDP2's
    all-gathers and reduce-scatters, grpokit's own sums; DDP's bucketed gradient all-reduce runs in C++ and is not
    seen here: it moves the trainable parameters' bytes once per step), and wall / CPU seconds per phase."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}  # name -> [count, bytes, seconds]
        self.phases: dict[str, list[float]] = {}  # name -> [wall, cpu]
        self.phase = "other"  # the phase collectives are counted under

    def patch_collectives(self) -> None:
        import torch.distributed as dist

        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._counted(name, original))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if hasattr(a, "element_size")]
            size = max((t.numel() * t.element_size() for t in tensors), default=0)  # the gathered / reduced size
            started = time.perf_counter()
            work = original(*args, **kwargs)
            if work is not None and hasattr(work, "wait"):
                work.wait()  # CPU (gloo): FSDP2 waits at once anyway
            row = self.calls.setdefault(f"{self.phase}: {name}", [0, 0, 0.0])
            row[0] += 1
            row[1] += size
            row[2] += time.perf_counter() - started
            return work
        return counted

    def timed(self, name, fn):
        def wrapper(*args, **kwargs):
            wall, cpu, outer = time.perf_counter(), time.process_time(), self.phase
            self.phase = name
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = outer
                row = self.phases.setdefault(name, [0.0, 0.0])
                row[0] += time.perf_counter() - wall
                row[1] += time.process_time() - cpu
        return wrapper

    def snapshot(self) -> dict:
        return {"calls": {k: list(v) for k, v in self.calls.items()},
                "phases": {k: list(v) for k, v in self.phases.items()}, "cpu": time.process_time()}


def per_step(first: dict, last: dict, steps: int) -> dict:
    """(last - first) / steps for every counter of two snapshots."""
    def delta(a, b):
        return {k: [(x - y) / steps for x, y in zip(v, a.get(k, [0] * len(v)))] for k, v in b.items()}
    return {"calls": delta(first["calls"], last["calls"]), "phases": delta(first["phases"], last["phases"]),
            "cpu": (last["cpu"] - first["cpu"]) / steps}


def worker(args) -> None:
    """One process of one mode: train `steps` steps, print this process's figures as JSON."""
    import datasets

    from grpokit.rollout.local import LocalEngine

    from grpokit.config import GRPOConfig
    from grpokit.trainer import GRPOTrainer

    options = dict(output_dir=args.out, per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=args.length, max_steps=args.steps, learning_rate=1e-5, beta=args.beta,
                   logging_steps=1, disable_tqdm=True, log_completions=False, save_strategy="no", seed=0)
    if args.worker == "fsdp":
        options["fsdp"] = "full_shard auto_wrap"
    data = datasets.Dataset.from_list([{"prompt": p} for p in prompts("real", 32)])
    import contextlib

    import grpokit.train.learner as learner_module

    counters = Counters()
    LocalEngine.generate = counters.timed("generation", LocalEngine.generate)
    gathered = learner_module.gathered_for_generation

    @contextlib.contextmanager
    def timed_gathered(*a, **k):  # FSDP: the whole policy gathered for generation, freed after
        context = gathered(*a, **k)
        counters.timed("gather for generation", context.__enter__)()
        try:
            yield
        finally:
            counters.timed("free after generation", context.__exit__)(None, None, None)

    learner_module.gathered_for_generation = timed_gathered
    trainer = GRPOTrainer(args.model, [count_vowels], GRPOConfig(**options), data,
                          processing_class=tokenizer_for("real"))
    counters.patch_collectives()  # after setup: the weights' broadcast and the like are not a step's
    learner = trainer.learner
    learner.prepare = counters.timed("prepare (log-prob passes)", learner.prepare)
    step, snapshots = counters.timed("update (forward, backward, optimizer)", learner.step), []

    def counted_step(*step_args, **step_kwargs):
        out = step(*step_args, **step_kwargs)
        snapshots.append(counters.snapshot())
        return out

    learner.step = counted_step
    started = time.perf_counter()
    trainer.train()
    rows = [r for r in trainer.state.log_history if "step_seconds" in r]
    figures = {"mode": args.worker, "rank": trainer.comm.rank, **state_bytes(trainer),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               "step_seconds": [r["step_seconds"] for r in rows], "wall": time.perf_counter() - started,
               "per_step": per_step(snapshots[0], snapshots[-1], len(snapshots) - 1) if len(snapshots) > 1 else None}
    sys.stdout.write("FIGURES " + json.dumps(figures) + "\n")  # one write: the two workers share the pipe
    sys.stdout.flush()


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (torchrun's workers may lead sessions of their own)."""
    import psutil  # accelerate's dependency

    try:
        family = [psutil.Process(pid)]
        family += family[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for process in family:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def run_mode(mode: str, args, model_dir: str, out: str, timeout: float) -> list[dict]:
    """Both processes' figures of one mode (a torchrun tree in its own session, killed whole on timeout)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
               "--worker", mode, "--model", model_dir, "--steps", str(args.steps), "--length", str(args.length),
               "--beta", str(args.beta), "--out", out]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        process.communicate(timeout=30)
        raise SystemExit(f"{mode}: no result within {timeout} s")
    lines = [json.loads(x.split("\n")[0]) for x in stdout.split("FIGURES ")[1:]]
    if process.returncode != 0 or len(lines) != 2:
        raise SystemExit(f"{mode} failed ({process.returncode}):\n{stderr[-3000:]}")
    return sorted(lines, key=lambda f: f["rank"])


def describe(step: dict) -> str:
    """One process's per-step figures (after the first step) as indented lines."""
    lines = [f"    per step: CPU {step['cpu']:.2f} s"]
    for name, (wall, cpu) in step["phases"].items():
        lines.append(f"    {name}: {wall:.2f} s wall, {cpu:.2f} s CPU")
    for name, (count, size, seconds) in sorted(step["calls"].items(), key=lambda kv: -kv[1][2]):
        if count:
            lines.append(f"    {name}: {count:.0f} calls, {size / 2**20:.0f} MiB, {seconds:.2f} s")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=["ddp", "fsdp"])
    parser.add_argument("--mode", choices=["ddp", "fsdp", "both"], default="both")
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=16, help="completion tokens")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient: > 0 adds a reference model and "
                        "its no-grad log-prob pass")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per process")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="fsdp2-bench-") as scratch:  # the model and the runs, removed after
        compare(args, scratch)


def compare(args, scratch: str) -> None:
    """Build the model into `scratch`, run each mode, print the figures."""
    folder = str(Path(scratch) / "model")
    model = tiny_qwen2(len(tokenizer_for("real")), hidden_size=args.hidden, num_layers=args.layers, seed=0,
                       num_heads=8)
    model.save_pretrained(folder)
    tokenizer_for("real").save_pretrained(folder)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, hidden {args.hidden}, "
          f"{args.layers} layers, vocab {model.config.vocab_size}")
    del model
    results = {}
    for mode in (["ddp", "fsdp"] if args.mode == "both" else [args.mode]):
        results[mode] = run_mode(mode, args, folder, str(Path(scratch) / mode), args.timeout)
        for f in results[mode]:
            steps = f["step_seconds"][1:] or f["step_seconds"]
            print(f"{mode} rank {f['rank']}: state {f['total'] / 2**20:.0f} MiB (params {f['params'] / 2**20:.0f}, "
                  f"grads {f['grads'] / 2**20:.0f}, AdamW {f['optimizer'] / 2**20:.0f}), peak RSS "
                  f"{f['peak_rss'] / 2**20:.0f} MiB, s/step {sum(steps) / len(steps):.2f} {f['step_seconds']}")
            if f["per_step"]:
                print(describe(f["per_step"]))
    if len(results) == 2:
        ratio = max(f["total"] for f in results["fsdp"]) / max(f["total"] for f in results["ddp"])
        print(f"FSDP2 / DDP per-process state: {ratio:.3f}")


if __name__ == "__main__":
    main()

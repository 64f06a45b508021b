"""Where a grpokit step spends its time on a workload: phases and the top operators.

    python benchmarks/profile_step.py [--workload real] [--steps 2] [--bf16]

Phases are timed by wrapping the trainer's own functions (generation, reference pass, update), each with its peak
resident memory (Linux's VmHWM, reset before the phase; the last step runs under the profiler, which adds its
own); operators come from torch.profiler over the last step (self CPU time, top 15). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from grpokit.rollout.local import LocalEngine  # noqa: E402
from worker import grpokit_trainer  # noqa: E402
from workloads import WORKLOADS, build_model_dir  # noqa: E402


def reset_peak_rss() -> None:
    """Start the process's peak-RSS count (VmHWM) afresh (Linux; elsewhere the peaks are the run's)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mib() -> float:
    """The process's peak resident memory since the last reset_peak_rss (VmHWM), MiB; 0 where unknown."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    return next((int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM:")), 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="real", choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if args.bf16:
        os.environ["BENCH_BF16"] = "1"
    workload = WORKLOADS[args.workload]
    seconds: dict[str, list[float]] = collections.defaultdict(list)

    peaks: dict[str, list[float]] = collections.defaultdict(list)

    def timed(name, fn):
        def wrapper(*a, **k):
            reset_peak_rss()
            started = time.perf_counter()
            out = fn(*a, **k)
            seconds[name].append(time.perf_counter() - started)
            peaks[name].append(peak_rss_mib())
            return out
        return wrapper

    LocalEngine.generate = timed("generation", LocalEngine.generate)
    with tempfile.TemporaryDirectory() as folder:
        build_model_dir(workload, Path(folder) / "model")
        trainer = grpokit_trainer(str(Path(folder) / "model"), workload, args.steps, str(Path(folder) / "out"))
        learner = trainer.learner
        learner.batched_logprobs = timed("reference / old log-prob pass", learner.batched_logprobs)
        learner.step = timed("update (forward + backward + AdamW)", learner.step)
        step = learner.step
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

        def last_step_profiled(*step_args):
            if trainer.state.global_step == args.steps - 1:
                with profiler:
                    return step(*step_args)
            return step(*step_args)

        learner.step = last_step_profiled
        trainer.train()
    for name, values in seconds.items():
        print(f"{name}: {' '.join(f'{v:.2f}' for v in values)} s, "
              f"peak RSS {' '.join(f'{m:.0f}' for m in peaks[name])} MiB")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

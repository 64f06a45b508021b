"""Launch the two-process (gloo) training of the tiny model N times in a row; count hangs and failures.

usage: python tests/scripts/stress_two_process.py N [--timeout S] [--max-staleness K] [--kill-resume]

Each launch is `accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_tiny.py` for 2 steps, run
through the test harness's `run_tree`, so a launch that outlives the timeout is killed whole and counted as a hang.
--max-staleness K trains with asynchronous rollouts (docs/async.md). --kill-resume makes each launch a 6-step run
that saves every step, SIGKILLs launcher and workers at a random moment after its first checkpoint, resumes it
with a second launch, and checks the resumed run against an uninterrupted one of the same options (every metric
but timings equal, final weights equal); a resume that does not finish is a hang, a difference a failure.
Prints one line per launch and a summary; exits 1 if any launch hung or failed.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))

from procs import TreeTimeout, kill_after_checkpoint, run_tree  # noqa: E402


TIMINGS = {"step_seconds", "tokens_per_second", "generation_seconds", "async/training_wait_seconds",
           "async/generation_wait_seconds", "async/generation_busy_seconds", "async/overlap"}


def launcher(model_dir: Path, out: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            str(TESTS / "scripts" / "train_tiny.py"), str(model_dir), str(out), "--per_device_train_batch_size", "8",
            *options]


def run_state(out: Path) -> tuple[list[dict], dict]:
    """The metrics rows without timings, and the final weights."""
    from safetensors.torch import load_file

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows], load_file(out / "model.safetensors")


def same_run(out: Path, reference: tuple[list[dict], dict]) -> str | None:
    """None when the run at `out` equals the reference exactly; else what differs."""
    import torch

    rows, weights = run_state(out)
    if rows != reference[0]:
        return f"metrics differ: steps {[r.get('step') for r in rows]}"
    different = [k for k in reference[1] if not torch.equal(weights[k], reference[1][k])]
    return f"weights differ: {different[:3]}" if different else None


def kill_then_resume(command: list[str], out: Path, env: dict, timeout: float) -> tuple[str, str]:
    """Start, SIGKILL the whole tree at a random moment after checkpoint-1, resume: (status, stderr of the resume)."""
    try:
        kill_after_checkpoint(command + ["--reward-sleep", "0.1"], out, env, (0.0, 1.5), timeout)
    except AssertionError as exc:  # wait_for's: the run ended early, or timed out waiting
        return ("HANG" if "timed out" in str(exc) else "exit") + " before checkpoint-1", str(exc)
    result = run_tree(command + ["--reward-sleep", "0.001", "--resume"], timeout, env=env)
    return ("ok" if result.returncode == 0 else f"resume exit {result.returncode}"), result.stderr


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("launches", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--max-staleness", type=int, default=0)
    parser.add_argument("--kill-resume", action="store_true")
    args = parser.parse_args()
    from grpokit.tiny import tiny_model_and_tokenizer

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    hangs = failures = 0
    seconds = []
    options = ["--max_staleness", str(args.max_staleness)]
    options += ["--max_steps", "6", "--save_strategy", "steps", "--save_steps", "1", "--completions_logging_steps",
                "1"] if args.kill_resume else ["--max_steps", "2", "--save_strategy", "no"]
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "model"
        model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        reference = None
        if args.kill_resume:
            done = run_tree(launcher(model_dir, Path(folder) / "reference", *options, "--reward-sleep", "0.001"),
                            args.timeout, env=env)
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            reference = run_state(Path(folder) / "reference")
        for launch in range(args.launches):
            out = Path(folder) / f"run{launch}"
            command = launcher(model_dir, out, *options)
            started = time.monotonic()
            try:
                if args.kill_resume:
                    status, stderr = kill_then_resume(command, out, env, args.timeout)
                    if status == "ok":
                        difference = same_run(out, reference)
                        status = "ok" if difference is None else f"DIFFERENT ({difference})"
                else:
                    result = run_tree(command, args.timeout, env=env)
                    status, stderr = ("ok" if result.returncode == 0 else f"exit {result.returncode}"), result.stderr
                hangs += status.startswith("HANG")
                failures += status != "ok" and not status.startswith("HANG")
                if status != "ok":
                    print(stderr[-2000:], file=sys.stderr)
            except TreeTimeout as exc:
                hangs += 1
                status = "HANG"
                print(exc.stderr[-3000:], file=sys.stderr)
            seconds.append(time.monotonic() - started)
            print(f"launch {launch + 1}/{args.launches}: {status} in {seconds[-1]:.1f} s", flush=True)
            shutil.rmtree(out, ignore_errors=True)
    print(f"{args.launches} launches: {hangs} hangs, {failures} failures; "
          f"{min(seconds):.1f}-{max(seconds):.1f} s each, {sum(seconds) / 60:.1f} min in all")
    return 1 if hangs or failures else 0


if __name__ == "__main__":
    sys.exit(main())

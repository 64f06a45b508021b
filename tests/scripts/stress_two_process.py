"""Launch the two-process (gloo) training of the tiny model N times in a row; count hangs and failures.

usage: python tests/scripts/stress_two_process.py N [--timeout S]

Each launch is `accelerate launch --multi_gpu --num_processes 2 tests/scripts/train_tiny.py` for 2 steps, run
through the test harness's `run_tree`, so a launch that outlives the timeout is killed whole and counted as a hang.
Prints one line per launch and a summary; exits 1 if any launch hung or failed.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS.parent))
sys.path.insert(0, str(TESTS))

from procs import TreeTimeout, run_tree  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("launches", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    from grpokit.tiny import tiny_model_and_tokenizer

    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    hangs = failures = 0
    seconds = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "model"
        model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        for launch in range(args.launches):
            out = Path(folder) / f"run{launch}"
            command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                       "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                       "--main_process_port", "0", str(TESTS / "scripts" / "train_tiny.py"), str(model_dir), str(out),
                       "--per_device_train_batch_size", "8", "--max_steps", "2", "--save_strategy", "no"]
            started = time.monotonic()
            try:
                result = run_tree(command, args.timeout, env=env)
                status = "ok" if result.returncode == 0 else f"exit {result.returncode}"
                failures += result.returncode != 0
                if result.returncode:
                    print(result.stderr[-2000:], file=sys.stderr)
            except TreeTimeout as exc:
                hangs += 1
                status = "HANG"
                print(exc.stderr[-3000:], file=sys.stderr)
            seconds.append(time.monotonic() - started)
            print(f"launch {launch + 1}/{args.launches}: {status} in {seconds[-1]:.1f} s", flush=True)
    print(f"{args.launches} launches: {hangs} hangs, {failures} failures; "
          f"{min(seconds):.1f}-{max(seconds):.1f} s each, {sum(seconds) / 60:.1f} min in all")
    return 1 if hangs or failures else 0


if __name__ == "__main__":
    sys.exit(main())

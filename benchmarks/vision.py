"""grpokit against TRL's GRPOTrainer on a vision-language workload, in one run:

    python benchmarks/vision.py [--engines grpokit,trl] [--repeats 1] [--steps 4]

The model: Qwen2.5-VL's own classes, random init (grpokit.tiny_vision.tiny_qwen2_5_vl): a 4-layer language model
of width 256 and a 4-block ViT of width 256 (patch 14, 2x2 merge, window attention), with the family's processor,
chat template and a character-level vocabulary (so every sampled token decodes). The data: 448x448 images of
random pixels (1,024 patches, 256 image tokens each) with a short question; G = 8 completions per prompt, 2
prompts per step (16 completions), every completion exactly 128 sampled tokens (min_new_tokens), beta 0.04 (a
reference model), loss dapo, learning rate 1e-6. Both trainers sample with their own local generation: this is a
whole sampled step, generation included.

Runs alternate engines, each in a fresh subprocess (peak RSS per run, from getrusage). The first step is warm-up;
seconds per step is the median of the other steps of all runs of an engine. "encoder passes" counts the vision
tower's forwards per step and the images they encoded (policy and reference together), from a hook on the tower.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

IMAGE_SIDE, GROUP, PROMPTS_PER_STEP, COMPLETION = 448, 8, 2, 128


def build_model(folder: Path) -> None:
    from grpokit.tiny_vision import save, tiny_qwen2_5_vl

    model, processor = tiny_qwen2_5_vl(hidden_size=256, num_layers=4, image_size=IMAGE_SIDE, vision_size=256)
    save(model, processor, folder)


def dataset(n: int = 16):
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)) for _ in range(n)]
    prompt = [{"role": "user", "content": "What is in this picture?"}]
    return datasets.Dataset.from_list([{"prompt": prompt, "image": image} for image in images])


def vowels(completions, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch in "aeiou" for ch in t) / (1 + len(t)) for t in texts]


def options(steps: int) -> dict:
    return dict(max_steps=steps, per_device_train_batch_size=GROUP * PROMPTS_PER_STEP, num_generations=GROUP,
                max_completion_length=COMPLETION, generation_kwargs={"min_new_tokens": COMPLETION}, beta=0.04,
                num_iterations=1, learning_rate=1e-6, loss_type="dapo", scale_rewards="group", seed=0,
                save_strategy="no", disable_tqdm=True, report_to=[], logging_steps=steps)


class Encoded:
    """Counts a vision tower's forwards and the images they encoded."""

    def __init__(self) -> None:
        self.calls, self.images = 0, 0

    def attach(self, model) -> None:
        tower = model.model.visual

        def hook(module, args, kwargs):
            grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
            self.calls += 1
            self.images += 0 if grid is None else int(grid.shape[0])

        tower.register_forward_pre_hook(hook, with_kwargs=True)


def run_grpokit(model_dir: str, steps: int, out_dir: str, encoded: Encoded, ends: list) -> None:
    from grpokit import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=out_dir, gradient_checkpointing=False, log_completions=False, **options(steps))
    trainer = GRPOTrainer(model_dir, vowels, args=args, train_dataset=dataset())
    for model in (trainer.learner.unwrapped, trainer.learner.ref_model):
        if model is not None:
            encoded.attach(model)
    step = trainer.learner.step

    def timed(*a):
        out = step(*a)
        ends.append(time.perf_counter())
        return out

    trainer.learner.step = timed
    ends.append(time.perf_counter())
    trainer.train()


def run_trl(model_dir: str, steps: int, out_dir: str, encoded: Encoded, ends: list) -> None:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpokit.tiny_vision import video_processor_optional

    video_processor_optional()  # no torchvision here: TRL's AutoProcessor needs the Qwen processor without video
    args = GRPOConfig(output_dir=out_dir, use_cpu=True, gradient_checkpointing=False, use_bias_correction_kl=False,
                      **options(steps))

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    trainer = GRPOTrainer(model_dir, vowels, args=args, train_dataset=dataset(), callbacks=[StepClock()])
    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is not None:
            encoded.attach(model)
    ends.append(time.perf_counter())
    trainer.train()


def worker(engine: str, model_dir: str, steps: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    encoded, ends = Encoded(), []
    with tempfile.TemporaryDirectory() as out_dir:
        (run_grpokit if engine == "grpokit" else run_trl)(model_dir, steps, out_dir, encoded, ends)
    row = dict(engine=engine, step_seconds=[b - a for a, b in zip(ends, ends[1:])],
               encoder_calls_per_step=encoded.calls / steps, images_encoded_per_step=encoded.images / steps,
               peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", default="grpokit,trl")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", nargs=4, metavar=("ENGINE", "MODEL", "STEPS", "OUT"))
    parser.add_argument("--timeout", type=float, default=3600)
    ns = parser.parse_args()
    if ns.worker:
        engine, model_dir, steps, out = ns.worker
        worker(engine, model_dir, int(steps), out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder, results = Path(tmp) / "model", Path(tmp) / "results.jsonl"
        build_model(folder)
        for _ in range(ns.repeats):
            for engine in ns.engines.split(","):
                command = [sys.executable, __file__, "--worker", engine, str(folder), str(ns.steps), str(results)]
                process = subprocess.run(command, timeout=ns.timeout, capture_output=True, text=True,
                                         start_new_session=True)
                if process.returncode != 0:
                    print(f"{engine} failed:\n{process.stderr[-3000:]}", file=sys.stderr)
        rows = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    print("| engine | s/step (median, after 1 warm-up) | peak RSS GiB | tower forwards / step | images encoded / step |")
    print("|---|---|---|---|---|")
    for engine in ns.engines.split(","):
        mine = [r for r in rows if r["engine"] == engine]
        if not mine:
            continue
        seconds = statistics.median(s for r in mine for s in r["step_seconds"][1:])
        print(f"| {engine} | {seconds:.2f} | {max(r['peak_rss_gib'] for r in mine):.2f} | "
              f"{mine[0]['encoder_calls_per_step']:.1f} | {mine[0]['images_encoded_per_step']:.1f} |")


if __name__ == "__main__":
    main()

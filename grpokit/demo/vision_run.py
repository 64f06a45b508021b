"""`grpo demo --task vision`: GRPO on the shipped warm vision-language model, offline on CPU, with held-out accuracy
before and after.

    run_vision_demo("outputs/demo-vision", steps=None, seed=0)

1. load the warm tiny Qwen2.5-VL shipped in grpokit/demo/vision_assets (vision_warmup.py made it) with its
   processor, and measure its greedy accuracy on held-out scenes (pictures it never trained on);
2. train it with GRPOTrainer on the training scenes (an `image` column of PIL images, conversational prompts),
   rewarded by `correctness_reward`;
3. measure the held-out accuracy again, save the model, plot the curves, write summary.json.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from datasets import Dataset

from grpokit.config import GRPOConfig
from grpokit.demo.run import report_held_out, stopped_early, write_summary
from grpokit.demo.vision_task import MAX_COMPLETION_LENGTH, REWARD_FUNCS, evaluate, split_scenes

ASSETS = Path(__file__).parent / "vision_assets"
DEFAULT_STEPS = 50

# Found by hand on a 2-core CPU (docs/vision.md): 8 scenes x 8 completions per step, one update per generation.
VISION_DEMO_OPTIONS = dict(
    num_generations=8,
    per_device_train_batch_size=64,
    learning_rate=3e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    beta=0.0,
    temperature=1.0,
    max_completion_length=MAX_COMPLETION_LENGTH,
    loss_type="dapo",
    logging_steps=1,
    log_completions=True,
    completions_logging_steps=10,
    save_strategy="no",
)


def vision_demo_config(output_dir: str | Path, steps: int, seed: int) -> GRPOConfig:
    return GRPOConfig(output_dir=str(output_dir), max_steps=steps, seed=seed, **VISION_DEMO_OPTIONS)


def load_vision_assets(path: str | Path | None = None):
    """The shipped warm (model, processor)."""
    from transformers import AutoModelForImageTextToText

    from grpokit.vision.processor import load_processor

    path = ASSETS if path is None else path
    return AutoModelForImageTextToText.from_pretrained(path), load_processor(str(path))


def run_vision_demo(output_dir: str | Path = "outputs/demo-vision", steps: int | None = None, seed: int = 0) -> dict:
    """Train the warm vision model with GRPO and report held-out accuracy before and after; returns the summary."""
    from grpokit.trainer import GRPOTrainer  # heavy import, after argument parsing

    started = time.perf_counter()
    output_dir = Path(output_dir)
    steps = DEFAULT_STEPS if steps is None else steps
    train, held_out = split_scenes()
    torch.manual_seed(seed)
    model, processor = load_vision_assets()
    accuracy_before = evaluate(model, processor, held_out)
    print(f"Warm model: {accuracy_before:.1%} of {len(held_out)} held-out pictures right (greedy).", flush=True)
    trainer = GRPOTrainer(model=model, reward_funcs=list(REWARD_FUNCS), args=vision_demo_config(output_dir, steps, seed),
                          train_dataset=Dataset.from_list([s.row() for s in train]), processing_class=processor)
    result = trainer.train()
    if result.interrupted:
        return stopped_early(result, steps, output_dir)
    train_seconds = time.perf_counter() - started
    accuracy_after = evaluate(trainer.unwrapped, processor, held_out)
    report_held_out(output_dir, steps, accuracy_before, accuracy_after)
    summary = {
        "task": "name the colour of the shape in an 84x84 picture (tiny Qwen2.5-VL)",
        "held_out_problems": len(held_out),
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "accuracy_gain": accuracy_after - accuracy_before,
        "steps": steps,
        "seed": seed,
        "rollout_engine": "local",
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "model": str(output_dir),
        "reward_curve": str(output_dir / "reward_curve.png"),
    }
    write_summary(output_dir, summary)
    gain = summary["accuracy_gain"] * 100
    print(f"GRPO, {steps} steps, seed {seed}: held-out accuracy {accuracy_before:.1%} -> {accuracy_after:.1%} "
          f"({gain:+.1f} points) on {len(held_out)} pictures the model never trained on, in "
          f"{summary['wall_seconds']:.0f} s.\nModel: {output_dir}  Curves: {summary['reward_curve']}", flush=True)
    return summary

"""A smoke run at the lowest versions pyproject.toml names (scripts/min_versions.sh installs them): a tiny model
trains 2 steps through the TRL-style API (packed passes, the loss inside the head, a reference model, a
checkpoint), resumes for a third, the sharded (FSDP2) module imports, and the demo's reward curves draw. Exits non-zero on any failure."""

import sys
import tempfile
from pathlib import Path

import datasets
import torch

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.tiny import tiny_model_and_tokenizer


def reward(prompts, completions, **kwargs):
    return [float(text.count("1")) for text in completions]


def main() -> None:
    torch.set_num_threads(1)
    print("torch", torch.__version__)
    root = Path(tempfile.mkdtemp(prefix="grpokit-min-"))
    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    data = datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(8)])
    options = dict(output_dir=str(root / "out"), per_device_train_batch_size=4, num_generations=4,
                   max_completion_length=6, beta=0.04, report_to=[], logging_steps=1, save_strategy="steps", save_steps=2,
                   seed=0)
    first = GRPOTrainer(str(root / "model"), reward, GRPOConfig(max_steps=2, **options), data)
    first.train()
    assert (root / "out" / "checkpoint-2").is_dir(), "no checkpoint written"
    resumed = GRPOTrainer(str(root / "model"), reward, GRPOConfig(max_steps=3, **options), data)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3, resumed.state.global_step
    import grpokit.train.fsdp  # noqa: F401 - FSDP2's public API at this torch
    from grpokit.demo.run import plot_curves

    plot_curves(root / "out" / "metrics.jsonl", root / "curves.png")  # matplotlib at its floor
    assert (root / "curves.png").stat().st_size > 0
    print("smoke run at the minimum versions: OK")


if __name__ == "__main__":
    sys.exit(main())

"""Train a tiny vision-language model on coloured squares from the command line: the multi-process tests.

usage: train_vision.py MODEL_DIR OUTPUT_DIR [--lora-r R] [--option value ...]
Options are GRPOConfig fields. The dataset: 8 prompts "Which colour is this?", each with a 56x56 square of one of
three colours (PIL images made here); the reward: the colour's name, else the share of lowercase letters (signal
from a random model's first step). --lora-r R trains a LoRA adapter on the language model's attention.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # this checkout's grpokit

import datasets  # noqa: E402
from PIL import Image  # noqa: E402

from grpokit.config import GRPOConfig, coerce_option  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230)}


def colour_rows(n: int = 8) -> datasets.Dataset:
    names = [list(COLOURS)[i % 3] for i in range(n)]
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "Which colour is this?"}],
                                        "image": Image.new("RGB", (56, 56), COLOURS[name]), "answer": name}
                                       for name in names])


def names_colour(completions, answer, image, **kwargs):
    texts = [c[0]["content"] for c in completions]
    return [1.0 if a in t else sum(ch.islower() for ch in t) / (1 + len(t)) for t, a in zip(texts, answer)]


def main() -> None:
    model_dir, output_dir, *rest = sys.argv[1:]
    options = dict(output_dir=output_dir, num_generations=4, max_completion_length=6, learning_rate=5e-3,
                   disable_tqdm=True, seed=0, logging_steps=1, report_to="none", save_strategy="no")
    peft_config = None
    for key, value in zip(rest[::2], rest[1::2]):
        key = key.lstrip("-")
        if key == "lora-r":
            from peft import LoraConfig

            peft_config = LoraConfig(r=int(value), target_modules=r".*language_model.*\.(q_proj|v_proj)",
                                     init_lora_weights=False)
        else:
            options[key] = coerce_option(key, value)
    trainer = GRPOTrainer(model_dir, names_colour, args=GRPOConfig(**options), train_dataset=colour_rows(),
                          peft_config=peft_config)
    trainer.train()


if __name__ == "__main__":
    main()

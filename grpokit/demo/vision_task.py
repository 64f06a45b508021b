"""The vision demo's task: one shape (a circle, a square or a triangle) of one of six colours, anywhere in an 84x84
picture; the question asks its colour.

    train, held_out = split_scenes()
    rows = [scene.row() for scene in train]          # {"prompt": messages, "image": PIL image, "answer": "red"}
    accuracy = evaluate(model, processor, held_out)  # greedy, the trainer's own decode loop

The answer is the colour's name alone (then the end of the turn). The reward is 1 for the right name, 0 else. The
trap is the neighbouring colour of the wheel red -> orange -> yellow -> green -> blue -> purple -> red: the warm-up
(vision_warmup.py) teaches the format and the colours, but labels most of its examples with the neighbour, so the
warm model prefers that mistake under greedy decoding and still samples the right name often enough for GRPO to
find it. Held-out scenes are pictures never trained on (other placements and sizes of every shape and colour).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

from grpokit.rewards.text import completion_text

COLOURS = {"red": (215, 40, 40), "orange": (245, 135, 25), "yellow": (235, 205, 30), "green": (40, 165, 60),
           "blue": (45, 80, 220), "purple": (135, 55, 180)}
WHEEL = list(COLOURS)  # each colour's neighbour is the next one
SHAPES = ("circle", "square", "triangle")
IMAGE_SIZE = 84  # pixels a side: Qwen2.5-VL's 14-pixel patches, a 6 x 6 grid, 9 image tokens after the 2 x 2 merge
VARIANTS = 16  # placements and sizes of each (colour, shape)
HELD_OUT_VARIANTS = 4
MAX_COMPLETION_LENGTH = 8


@dataclass(frozen=True)
class Scene:
    colour: str
    shape: str
    variant: int

    @property
    def answer(self) -> str:
        return self.colour

    @property
    def other(self) -> str:
        """The trap: the next colour of the wheel."""
        return WHEEL[(WHEEL.index(self.colour) + 1) % len(WHEEL)]

    def image(self):
        """84x84 RGB: a light background and the shape, 24-44 pixels across, placed by the variant."""
        from PIL import Image, ImageDraw

        rng = random.Random(zlib.crc32(f"{self.colour} {self.shape} {self.variant}".encode()))
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (235, 235, 228))
        size = rng.randint(24, 44)
        x0, y0 = rng.randint(2, IMAGE_SIZE - size - 2), rng.randint(2, IMAGE_SIZE - size - 2)
        fill, draw = COLOURS[self.colour], ImageDraw.Draw(image)
        if self.shape == "circle":
            draw.ellipse((x0, y0, x0 + size, y0 + size), fill=fill)
        elif self.shape == "square":
            draw.rectangle((x0, y0, x0 + size, y0 + size), fill=fill)
        else:
            draw.polygon([(x0 + size // 2, y0), (x0, y0 + size), (x0 + size, y0 + size)], fill=fill)
        return image

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What colour is the shape?"}]}]

    def row(self) -> dict:
        return {"prompt": self.prompt(), "image": self.image(), "answer": self.answer}


def all_scenes() -> list[Scene]:
    return [Scene(c, s, v) for c in COLOURS for s in SHAPES for v in range(VARIANTS)]


def split_scenes(held_out_variants: int = HELD_OUT_VARIANTS) -> tuple[list[Scene], list[Scene]]:
    """Train and held-out scenes: the held-out ones are the last `held_out_variants` placements of every colour
    and shape (pictures never trained on)."""
    cut = VARIANTS - held_out_variants
    scenes = all_scenes()
    return [s for s in scenes if s.variant < cut], [s for s in scenes if s.variant >= cut]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is the shape's colour (case and surrounding spaces ignored), else 0.0."""
    return [float(completion_text(c).strip().lower() == a) for c, a in zip(completions, answer)]


REWARD_FUNCS = (correctness_reward,)


def encode(processor, scenes: list[Scene]):
    """Each scene's prompt ids and PromptVision, through the processor as the trainer encodes them."""
    from grpokit.vision import encode_prompt, with_image_parts

    return [encode_prompt(processor, with_image_parts(s.prompt(), [s.image()], "scene")) for s in scenes]


@torch.no_grad()
def answers(model, processor, scenes: list[Scene], greedy: bool = True, samples: int = 1, seed: int = 0,
            batch: int = 64) -> list[str]:
    """Each scene's completion text(s) from the trainer's own decode loop: greedy, or `samples` draws each at
    temperature 1 (scene-major order)."""
    from grpokit.rollout.engine import SamplingParams
    from grpokit.rollout.generate import generate_completions

    encoded = [e for e in encode(processor, scenes) for _ in range(samples)]
    params = SamplingParams(MAX_COMPLETION_LENGTH, top_k=1 if greedy else 0)
    texts = []
    for start in range(0, len(encoded), batch):
        part = encoded[start : start + batch]
        out = generate_completions(model, processor.tokenizer, [p for p, _ in part],
                                   torch.arange(start, start + len(part)), params, seed,
                                   vision=[v for _, v in part])
        texts += processor.tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    return texts


def evaluate(model, processor, scenes: list[Scene]) -> float:
    """Greedy accuracy on `scenes`."""
    texts = answers(model, processor, scenes)
    return sum(t.strip().lower() == s.answer for t, s in zip(texts, scenes)) / len(scenes)


def sampling_profile(model, processor, scenes: list[Scene], group: int = 8) -> dict[str, float]:
    """At temperature 1, `group` samples per scene: the share right, the share naming the neighbouring colour,
    and the share of groups with both a right and a wrong answer (the groups GRPO learns from)."""
    texts = answers(model, processor, scenes, greedy=False, samples=group)
    right = [t.strip().lower() == s.answer for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    other = [t.strip().lower() == s.other for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    groups = [right[k : k + group] for k in range(0, len(right), group)]
    return {"correct": sum(right) / len(right), "other_colour": sum(other) / len(other),
            "groups_with_signal": sum(0 < sum(g) < group for g in groups) / len(groups)}

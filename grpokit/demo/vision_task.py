"""The vision demo's task: a circle and a square of two different colours; the question asks the colour of one.

    train, held_out = split_scenes()
    rows = [scene.row() for scene in train]          # {"prompt": messages, "image": PIL image, "answer": "red"}
    accuracy = evaluate(model, processor, held_out)  # greedy, the trainer's own decode loop

The answer is the colour's name alone (then the end of the turn). The reward is 1 for the right name, 0 else. The
trap a model falls into is the other shape's colour: the warm-up (vision_warmup.py) teaches the format, the colours
and the shapes, but labels half its examples with the other shape's colour, so the warm model prefers that mistake
under greedy decoding and still samples the right answer often enough for GRPO to find it. Held-out scenes use
colour pairs the training scenes never show together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

COLOURS = {"red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 80, 220), "yellow": (235, 205, 30),
           "purple": (135, 55, 180), "orange": (245, 135, 25)}
SHAPES = ("circle", "square")
IMAGE_SIZE = 84  # pixels a side: Qwen2.5-VL's 14-pixel patches, a 6 x 6 grid, 9 image tokens after the 2 x 2 merge
VARIANTS = 6  # placements of each (colours, sides, question) combination
MAX_COMPLETION_LENGTH = 8


@dataclass(frozen=True)
class Scene:
    circle: str  # its colour
    square: str
    circle_left: bool
    asked: str  # "circle" or "square"
    variant: int

    @property
    def answer(self) -> str:
        return self.circle if self.asked == "circle" else self.square

    @property
    def other(self) -> str:
        return self.square if self.asked == "circle" else self.circle

    def image(self):
        """84x84 RGB: a light background, the circle in one half and the square in the other, each 26-32 pixels
        across at a position jittered by the variant."""
        from PIL import Image, ImageDraw

        rng = random.Random(hash((self.circle, self.square, self.circle_left, self.variant)) & 0xFFFFFFFF)
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (235, 235, 228))
        draw = ImageDraw.Draw(image)
        for shape, left in (("circle", self.circle_left), ("square", not self.circle_left)):
            size = rng.randint(26, 32)
            x0 = rng.randint(2, IMAGE_SIZE // 2 - size - 2) + (0 if left else IMAGE_SIZE // 2)
            y0 = rng.randint(6, IMAGE_SIZE - size - 6)
            box = (x0, y0, x0 + size, y0 + size)
            colour = COLOURS[getattr(self, shape)]
            (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colour)
        return image

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": f"What colour is the {self.asked}?"}]}]

    def row(self) -> dict:
        return {"prompt": self.prompt(), "image": self.image(), "answer": self.answer}


def all_scenes() -> list[Scene]:
    return [Scene(c, s, left, asked, v) for c in COLOURS for s in COLOURS if c != s for left in (True, False)
            for asked in SHAPES for v in range(VARIANTS)]


def split_scenes(held_out_pairs: int = 6, seed: int = 0) -> tuple[list[Scene], list[Scene]]:
    """Train and held-out scenes; the held-out ones use `held_out_pairs` (circle, square) colour pairs that no
    training scene has."""
    pairs = sorted({(s.circle, s.square) for s in all_scenes()})
    held = set(random.Random(seed).sample(pairs, held_out_pairs))
    scenes = all_scenes()
    return [s for s in scenes if (s.circle, s.square) not in held], [s for s in scenes if (s.circle, s.square) in held]


def completion_text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is the asked shape's colour (case and surrounding spaces ignored), else 0.0."""
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
    """At temperature 1, `group` samples per scene: the share right, the share naming the other shape's colour,
    and the share of groups with both a right and a wrong answer (the groups GRPO learns from)."""
    texts = answers(model, processor, scenes, greedy=False, samples=group)
    right = [t.strip().lower() == s.answer for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    other = [t.strip().lower() == s.other for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    groups = [right[k : k + group] for k in range(0, len(right), group)]
    return {"correct": sum(right) / len(right), "other_colour": sum(other) / len(other),
            "groups_with_signal": sum(0 < sum(g) < group for g in groups) / len(groups)}

"""The vision demo's task: two shapes of two different colours, one on the left and one on the right; the question
asks the colour of one side's shape.

    train, held_out = split_scenes()
    rows = [scene.row() for scene in train]          # {"prompt": messages, "image": PIL image, "answer": "red"}
    accuracy = evaluate(model, processor, held_out)  # greedy, the trainer's own decode loop

The answer is the colour's name alone (then the end of the turn). The reward is 1 for the right name, 0 else. The
trap is the other side's colour: the warm-up (vision_warmup.py) teaches the format, the colours and where they are,
but labels most of its examples with the other side's colour, so the warm model prefers that mistake under greedy
decoding and still samples the right answer often enough for GRPO to find it. Held-out scenes use colour pairs the
training scenes never show together, on either side.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import torch

COLOURS = {"red": (215, 40, 40), "green": (40, 165, 60), "blue": (45, 80, 220), "yellow": (235, 205, 30),
           "purple": (135, 55, 180), "orange": (245, 135, 25)}
SIDES = ("left", "right")
IMAGE_SIZE = 84  # pixels a side: Qwen2.5-VL's 14-pixel patches, a 6 x 6 grid, 9 image tokens after the 2 x 2 merge
VARIANTS = 6  # placements of each (colours, sides, question) combination
MAX_COMPLETION_LENGTH = 8


@dataclass(frozen=True)
class Scene:
    left: str  # the colour of the shape on the left
    right: str
    circle_left: bool  # a circle on the left and a square on the right, or the other way round
    asked: str  # "left" or "right"
    variant: int

    @property
    def answer(self) -> str:
        return self.left if self.asked == "left" else self.right

    @property
    def other(self) -> str:
        return self.right if self.asked == "left" else self.left

    def image(self):
        """84x84 RGB: a light background, a shape in each half (a circle and a square), each 26-32 pixels across
        at a position jittered by the variant."""
        from PIL import Image, ImageDraw

        rng = random.Random(zlib.crc32(f"{self.left} {self.right} {self.circle_left} {self.variant}".encode()))
        image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (235, 235, 228))
        draw = ImageDraw.Draw(image)
        for side, circle in (("left", self.circle_left), ("right", not self.circle_left)):
            size = rng.randint(26, 32)
            x0 = rng.randint(2, IMAGE_SIZE // 2 - size - 2) + (0 if side == "left" else IMAGE_SIZE // 2)
            y0 = rng.randint(6, IMAGE_SIZE - size - 6)
            box = (x0, y0, x0 + size, y0 + size)
            (draw.ellipse if circle else draw.rectangle)(box, fill=COLOURS[getattr(self, side)])
        return image

    def prompt(self) -> list[dict]:
        return [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                 "text": f"What colour is the {self.asked} shape?"}]}]

    def row(self) -> dict:
        return {"prompt": self.prompt(), "image": self.image(), "answer": self.answer}


def all_scenes() -> list[Scene]:
    return [Scene(a, b, circle, asked, v) for a in COLOURS for b in COLOURS if a != b for circle in (True, False)
            for asked in SIDES for v in range(VARIANTS)]


def split_scenes(held_out_pairs: int = 3, seed: int = 0) -> tuple[list[Scene], list[Scene]]:
    """Train and held-out scenes; the held-out ones use `held_out_pairs` pairs of colours that no training scene
    shows together, on either side (a model cannot answer them from the pair it remembers)."""
    pairs = sorted({frozenset((s.left, s.right)) for s in all_scenes()}, key=sorted)
    held = set(random.Random(seed).sample(pairs, held_out_pairs))
    scenes = all_scenes()
    return ([s for s in scenes if frozenset((s.left, s.right)) not in held],
            [s for s in scenes if frozenset((s.left, s.right)) in held])


def completion_text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def correctness_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion is the asked side's colour (case and surrounding spaces ignored), else 0.0."""
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
    """At temperature 1, `group` samples per scene: the share right, the share naming the other side's colour,
    and the share of groups with both a right and a wrong answer (the groups GRPO learns from)."""
    texts = answers(model, processor, scenes, greedy=False, samples=group)
    right = [t.strip().lower() == s.answer for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    other = [t.strip().lower() == s.other for t, s in zip(texts, (s for s in scenes for _ in range(group)))]
    groups = [right[k : k + group] for k in range(0, len(right), group)]
    return {"correct": sum(right) / len(right), "other_colour": sum(other) / len(other),
            "groups_with_signal": sum(0 < sum(g) < group for g in groups) / len(groups)}

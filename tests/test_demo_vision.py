"""The vision demo: its task (scenes, split, images, reward), the warm-up's labels and loss, the shipped warm model
as the trainer loads it, and the demo itself (held-out accuracy up by at least 30 points in at most 5 minutes)."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.demo.vision_task import COLOURS, IMAGE_SIZE, Scene, correctness_reward, encode, split_scenes
from grpokit.demo.vision_warmup import VisionWarmupConfig, batch_tokens, label

ROOT = Path(__file__).resolve().parent.parent


def test_the_split_holds_out_placements_of_every_colour_and_shape():
    train, held_out = split_scenes()
    assert len(train) + len(held_out) == 6 * 3 * 16 and len(held_out) == 6 * 3 * 4
    assert not set(train) & set(held_out)
    assert {(s.colour, s.shape) for s in held_out} == {(s.colour, s.shape) for s in train}
    assert len({s.image().tobytes() for s in held_out + train}) == 6 * 3 * 16  # every picture its own


def test_a_scene_draws_the_same_picture_in_every_process():
    code = ("from grpokit.demo.vision_task import Scene; import hashlib; "
            "print(hashlib.sha1(Scene('red', 'triangle', 3).image().tobytes()).hexdigest())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (1, 2)}
    assert len(runs) == 1 and len(next(iter(runs)).strip()) == 40
    image = Scene("red", "triangle", 3).image()
    assert image.size == (IMAGE_SIZE, IMAGE_SIZE)
    pixels = {image.getpixel((x, y)) for x in range(IMAGE_SIZE) for y in range(IMAGE_SIZE)}
    assert COLOURS["red"] in pixels and not pixels & {v for k, v in COLOURS.items() if k != "red"}


def test_the_reward_wants_the_asked_sides_colour_alone():
    completions = [[{"role": "assistant", "content": c}] for c in ("red", " Red ", "blue", "red red", "")]
    assert correctness_reward(completions, ["red"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_warm_up_labels_follow_their_probabilities():
    config, rng = VisionWarmupConfig(), random.Random(0)
    scene = Scene("purple", "square", 0)
    assert scene.other == "red"  # the wheel wraps round
    drawn = [label(scene, config, rng) for _ in range(4000)]
    assert abs(drawn.count("purple") / 4000 - config.p_correct) < 0.03
    assert abs(drawn.count("red") / 4000 - config.p_other) < 0.03
    assert set(drawn) <= set(COLOURS)


def test_warm_up_batches_put_the_label_and_the_end_of_turn_in_the_completion():
    from grpokit.tiny_vision import tiny_qwen2_5_vl

    _, processor = tiny_qwen2_5_vl(image_size=IMAGE_SIZE)
    scenes = split_scenes()[0][:2]
    tokens = batch_tokens(processor.tokenizer, encode(processor, scenes), ["red", "green"])
    text = processor.tokenizer.batch_decode(tokens.completion_ids)
    assert text[0].startswith("red<|im_end|>") and text[1] == "green<|im_end|>"
    assert tokens.has_images and tokens.completion_mask.sum().item() == 4 + 6


def test_the_shipped_warm_model_prefers_the_neighbouring_colour():
    from grpokit.demo.vision_run import ASSETS, load_vision_assets
    from grpokit.demo.vision_task import answers

    record = json.loads((ASSETS / "warmup.json").read_text())
    model, processor = load_vision_assets()
    held_out = split_scenes()[1][:48]
    texts = answers(model, processor, held_out)
    other = sum(t.strip() == s.other for t, s in zip(texts, held_out)) / len(held_out)
    right = sum(t.strip() == s.answer for t, s in zip(texts, held_out)) / len(held_out)
    assert other > right, (other, right)
    assert record["sampling_profile"]["groups_with_signal"] > 0.5


@pytest.mark.slow
def test_vision_demo_learns_to_name_the_colour(tmp_path):
    """The issue's bar: held-out accuracy up by at least 30 points in at most 5 minutes on the 2-core CPU."""
    result = subprocess.run([sys.executable, "-m", "grpokit.cli", "demo", "--task", "vision", "--output-dir",
                             str(tmp_path / "demo")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["accuracy_gain"] >= 0.30, summary
    assert summary["wall_seconds"] < 300
    assert (tmp_path / "demo" / "reward_curve.png").stat().st_size > 10_000
    assert "held-out accuracy" in result.stdout
    logged = [json.loads(line) for line in (tmp_path / "demo" / "completions.jsonl").read_text().splitlines()]
    assert logged and all(r["images"][0].startswith("data:image/png;base64,") for r in logged)


def test_the_vision_demo_refuses_vllm_and_staleness(capsys):
    from grpokit.cli import main

    assert main(["demo", "--task", "vision", "--use-vllm"]) == 2
    assert "runs with the local engine" in capsys.readouterr().err

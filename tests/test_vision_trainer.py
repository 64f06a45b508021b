"""Vision-language training through GRPOTrainer, as TRL users run it: a saved model folder of each family, its
processor (AutoProcessor when processing_class is omitted), an `image` or `images` column or image parts, rewards
that read the images; evaluation, num_iterations, steps_per_generation, the reference model and exact resume."""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.tiny_vision import FAMILIES, save

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (40, 60, 230)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name, build in FAMILIES.items():
        model, processor = build()
        out[name] = str(save(model, processor, tmp_path_factory.mktemp(name)))
    return out


def colour_rows(n: int = 8, column: str = "image", form: str = "pil", tmp_path: Path | None = None):
    rows = []
    for i in range(n):
        name = list(COLOURS)[i % 3]
        image = Image.new("RGB", (56, 56), COLOURS[name])
        if form == "bytes":
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            image = buffer.getvalue()
        elif form == "path":
            path = tmp_path / f"{i}.png"
            image.save(path)
            image = str(path)
        rows.append({"prompt": [{"role": "user", "content": "Which colour is this?"}], "answer": name,
                     column: [image] if column == "images" else image})
    return datasets.Dataset.from_list(rows)


def names_colour(completions, answer, **kwargs):
    images = kwargs.get("image", kwargs.get("images"))
    assert images is not None and len(images) == len(completions)  # the rewards see the row's images
    # the colour's name, else the share of lowercase letters: varied from a random model's first step
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # plain prompts: strings
    return [1.0 if a in t else sum(ch.islower() for ch in t) / (1 + len(t)) for t, a in zip(texts, answer)]


def config(tmp_path, name="out", **overrides):
    values = dict(output_dir=str(tmp_path / name), num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=6, max_steps=2, learning_rate=5e-3, logging_steps=1, report_to="none",
                  save_strategy="no", disable_tqdm=True, seed=0)
    values.update(overrides)
    return GRPOConfig(**values)


def rows_of(folder):
    return [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_trains_from_its_folder_with_its_processor(tmp_path, folders, family):
    """The language model and the vision tower both move; the logged loss is finite; beta > 0 loads the
    reference through the same class."""
    before = load_file(str(Path(folders[family]) / "model.safetensors"))
    args = config(tmp_path, beta=0.04, num_iterations=2)
    trainer = GRPOTrainer(folders[family], names_colour, args=args, train_dataset=colour_rows())
    trainer.train()
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert after.keys() == before.keys()
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    # each family's checkpoint names (Gemma 3 saves `vision_tower.`, Qwen `model.visual.`, ...)
    vision = [k for k in moved if any(part in k for part in ("visual.", "vision_tower.", "vision_model."))]
    assert vision and len(vision) < len(moved)  # the tower and the language model
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows_of(tmp_path / "out") if "loss" in r)


@pytest.mark.parametrize("column, form", [("image", "bytes"), ("image", "path"), ("images", "pil")])
def test_image_columns_in_every_form_give_the_same_run(tmp_path, folders, column, form):
    reference = tmp_path / "reference"
    GRPOTrainer(folders["qwen2_5_vl"], names_colour, args=config(tmp_path, "reference"),
                train_dataset=colour_rows()).train()
    GRPOTrainer(folders["qwen2_5_vl"], names_colour, args=config(tmp_path, "other"),
                train_dataset=colour_rows(column=column, form=form, tmp_path=tmp_path)).train()
    keys = ("loss", "reward", "completions/mean_length")
    assert [[r[k] for k in keys] for r in rows_of(reference)] == [[r[k] for k in keys]
                                                                    for r in rows_of(tmp_path / "other")]


def test_the_datasets_image_feature_and_image_parts_of_their_own(tmp_path, folders):
    """A column cast to datasets.Image() (stored as PNG bytes, decoded on access) trains exactly as the PIL
    column; prompts whose image part names its own file (no image column) train as well."""
    plain = colour_rows()
    cast = plain.cast_column("image", datasets.Image())
    own = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": [
        {"type": "image", "path": str(_saved(tmp_path, r["image"], i))},
        {"type": "text", "text": "Which colour is this?"}]}], "answer": r["answer"]} for i, r in enumerate(plain)])

    def lowercase(completions, **kwargs):
        return [sum(ch.islower() for ch in c[0]["content"]) / (1 + len(c[0]["content"])) for c in completions]

    runs = {}
    for name, dataset, reward in (("plain", plain, names_colour), ("cast", cast, names_colour),
                                  ("own", own, lowercase)):
        GRPOTrainer(folders["gemma3"], reward, args=config(tmp_path, name), train_dataset=dataset).train()
        runs[name] = [r["loss"] for r in rows_of(tmp_path / name) if "loss" in r]
    assert runs["plain"] == runs["cast"]
    assert len(runs["own"]) == 2


def _saved(tmp_path, image, i):
    path = tmp_path / f"own{i}.png"
    image.save(path)
    return path


@pytest.mark.parametrize("plain", [False, True])
def test_rows_without_images_mix_with_image_rows(tmp_path, folders, plain):
    """TRL's None image (a row without) beside image rows; a plain string prompt with an image becomes one user
    turn (TRL refuses it), a plain one without stays text."""
    rows = [{"prompt": "Which colour is this?" if plain else [{"role": "user", "content": "Which colour is this?"}],
             "image": Image.new("RGB", (56, 56), COLOURS["red"]) if i % 2 else None, "answer": "red"}
            for i in range(8)]
    trainer = GRPOTrainer(folders["qwen2_vl"], names_colour, args=config(tmp_path),
                          train_dataset=datasets.Dataset.from_list(rows))
    with_image, without = trainer.setup.prompt_ids[1], trainer.setup.prompt_ids[0]
    image_pad = trainer.setup.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert image_pad in with_image and image_pad not in without
    trainer.train()
    assert len([r for r in rows_of(tmp_path / "out") if "loss" in r]) == 2


def test_evaluation_steps_per_generation_and_a_model_object(tmp_path, folders):
    """An eval set with images, steps_per_generation 2 (micro-batches of a generation batch), the model and
    processor given as objects."""
    model, processor = FAMILIES["llava_next"]()
    args = config(tmp_path, per_device_train_batch_size=4, steps_per_generation=2, eval_strategy="steps",
                  eval_steps=1, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(model, names_colour, args=args, train_dataset=colour_rows(), eval_dataset=colour_rows(4),
                          processing_class=processor)
    trainer.train()
    evals = [r for r in rows_of(tmp_path / "out") if "eval/reward" in r]
    assert len(evals) == 2 and all(0.0 <= r["eval/reward"] <= 1.0 for r in evals)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_vl", "gemma3"])
def test_resume_is_exact(tmp_path, folders, family):
    """Qwen2-VL and Gemma 3 checkpoints are saved under other names than the model's (transformers 5 renames them
    on save): the resume maps them back."""
    common = dict(max_steps=4, beta=0.04, num_iterations=2, lr_scheduler_type="constant")
    GRPOTrainer(folders[family], names_colour, args=config(tmp_path, "straight", **common),
                train_dataset=colour_rows()).train()
    first = config(tmp_path, "resumed", **{**common, "max_steps": 2}, save_strategy="steps", save_steps=2)
    GRPOTrainer(folders[family], names_colour, args=first, train_dataset=colour_rows()).train()
    second = config(tmp_path, "resumed", **common, save_strategy="steps", save_steps=2)
    GRPOTrainer(folders[family], names_colour, args=second,
                train_dataset=colour_rows()).train(resume_from_checkpoint=True)
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    keys = ("loss", "reward")
    assert [[r[k] for k in keys] for r in rows_of(tmp_path / "straight") if "loss" in r] == \
        [[r[k] for k in keys] for r in rows_of(tmp_path / "resumed") if "loss" in r]


def _adapted(trainer) -> list[str]:
    return [n for n, p in trainer.learner.unwrapped.named_parameters() if "lora_" in n]


@pytest.mark.parametrize("freeze", [None, False])
def test_a_lora_adapter_goes_on_the_language_model_unless_the_tower_is_asked_for(tmp_path, folders, freeze):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    trainer = GRPOTrainer(folders["gemma3"], names_colour, args=config(tmp_path, freeze_vision_tower=freeze),
                          train_dataset=colour_rows(), peft_config=lora)
    adapted = _adapted(trainer)
    in_tower = [n for n in adapted if "vision_tower" in n]
    assert adapted and (not in_tower if freeze is None else in_tower)
    assert lora.exclude_modules is None  # the user's config is not changed
    trainer.train()
    assert len([r for r in rows_of(tmp_path / "out") if "loss" in r]) == 2


def test_a_frozen_tower_does_not_move_in_a_full_fine_tune(tmp_path, folders):
    before = load_file(str(Path(folders["smolvlm"]) / "model.safetensors"))
    GRPOTrainer(folders["smolvlm"], names_colour, args=config(tmp_path, freeze_vision_tower=True),
                train_dataset=colour_rows()).train()
    after = load_file(str(tmp_path / "out" / "model.safetensors"))
    tower = [k for k in before if "vision_model." in k]
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in tower)


def test_gradient_checkpointing_gives_the_same_run(tmp_path, folders):
    """Gradient checkpointing turns the KV cache off, so each row's prompt runs with its images in the forward
    (the non-shared path): the same losses and weights as the shared pass."""
    for name, checkpointing in (("plain", False), ("checkpointed", True)):
        GRPOTrainer(folders["qwen3_vl"], names_colour, args=config(tmp_path, name, beta=0.04, num_iterations=2,
                                                                   gradient_checkpointing=checkpointing),
                    train_dataset=colour_rows()).train()
    a = [r["loss"] for r in rows_of(tmp_path / "plain") if "loss" in r]
    b = [r["loss"] for r in rows_of(tmp_path / "checkpointed") if "loss" in r]
    assert a == pytest.approx(b, abs=1e-6)
    wa = load_file(str(tmp_path / "plain" / "model.safetensors"))
    wb = load_file(str(tmp_path / "checkpointed" / "model.safetensors"))
    # Adam divides each gradient by its own root mean square, so a float-rounding difference in a near-zero
    # gradient element moves that weight by up to ~lr (5e-3) a step; the bulk must agree far tighter than that
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 2e-4


def test_logged_completions_carry_their_images_and_the_report_shows_them(tmp_path, folders):
    import base64

    from grpokit.report import write_report

    args = config(tmp_path, log_completions=True, completions_logging_steps=1)
    GRPOTrainer(folders["qwen2_vl"], names_colour, args=args, train_dataset=colour_rows()).train()
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert rows and all(len(r["images"]) == 1 for r in rows)
    head, _, data = rows[0]["images"][0].partition(",")
    assert head == "data:image/png;base64"
    thumb = Image.open(io.BytesIO(base64.b64decode(data)))
    assert max(thumb.size) <= 96 and thumb.convert("RGB").getpixel((10, 10)) in COLOURS.values()
    # a hostile completions.jsonl: an `images` entry that is not a PNG/JPEG data URI is not rendered
    hostile = dict(rows[0], images=['x" onerror="alert(1)', "javascript:alert(1)"], completion="hostile")
    with open(tmp_path / "out" / "completions.jsonl", "a") as f:
        f.write(json.dumps(hostile) + "\n")
    page = Path(write_report(tmp_path / "out")).read_text()
    assert '<img class="thumb"' in page and "onerror" not in page and "javascript:alert" not in page
    assert page.count('<img class="thumb"') >= 1 and "user: Which colour is this?" in page


class Looking:
    """An environment whose reset() extends the prompt (the prompt is encoded again with its image: Qwen3-VL's
    positions would fail on per-token fields of the unextended prompt) and whose method the model calls every turn
    (through the test_every_turn format)."""

    def reset(self, **row):
        return "Look at the middle of the picture."

    def echo(self, text: str) -> str:
        """Repeat a text in capitals.

        Args:
            text: The text.
        """
        return text.upper()


@pytest.mark.parametrize("agent", ["tools", "environment"])
def test_image_prompts_with_tools_and_environments(tmp_path, folders, agent):
    """Multi-turn episodes on image prompts: every turn a call (the test format), the results appended as tokens;
    the episode's prompt images reach every turn's generation and the passes (tool tokens in context, not loss)."""
    from helpers import echo, register_test_formats

    register_test_formats()
    kwargs = dict(tools=[echo]) if agent == "tools" else dict(environment_factory=Looking)
    args = config(tmp_path, max_completion_length=160, max_prompt_length=2048, tool_call_format="test_every_turn",
                  max_tool_calling_iterations=2, log_completions=True, completions_logging_steps=1)
    GRPOTrainer(folders["qwen3_vl"], names_colour, args=args, train_dataset=colour_rows(), **kwargs).train()
    rows = rows_of(tmp_path / "out")
    assert all(r["tools/call_frequency"] > 0 for r in rows if "loss" in r)
    assert all(r["tools/turns_mean"] > 1.5 for r in rows if "loss" in r)  # later turns: prompt + earlier turns
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    logged = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").read_text().splitlines()]
    assert all(r["images"] for r in logged)


def test_grpo_train_reads_image_paths_from_a_jsonl(tmp_path, folders):
    """The command line: a JSONL whose `image` column holds file paths, plain prompts, a reward by import path."""
    from grpokit.cli import main

    lines = []
    for i, name in enumerate(list(COLOURS) * 3):
        path = tmp_path / f"{i}.png"
        Image.new("RGB", (56, 56), COLOURS[name]).save(path)
        lines.append(json.dumps({"prompt": "Which colour is this?", "image": str(path)}))
    (tmp_path / "data.jsonl").write_text("\n".join(lines[:8]) + "\n")
    (tmp_path / "run.yaml").write_text(
        f"model: {folders['smolvlm']}\ndataset: {tmp_path / 'data.jsonl'}\nreward_funcs: ['helpers:frac_a']\n"
        f"output_dir: {tmp_path / 'out'}\nnum_generations: 4\nper_device_train_batch_size: 8\n"
        "max_completion_length: 6\nmax_steps: 2\nlogging_steps: 1\nreport_to: none\nsave_strategy: 'no'\n")
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert len([r for r in rows_of(tmp_path / "out") if "loss" in r]) == 2


def test_asynchronous_rollouts_with_images_resume_exactly(tmp_path, folders):
    """max_staleness 1: the producer thread encodes its own batches' images; checkpoint-2 holds the batch made
    ahead (its images with it), and a run resumed from it ends with the uninterrupted run's weights."""
    common = dict(max_steps=4, max_staleness=1, lr_scheduler_type="constant", save_strategy="steps", save_steps=2)
    GRPOTrainer(folders["qwen2_vl"], names_colour, args=config(tmp_path, "straight", **common),
                train_dataset=colour_rows()).train()
    assert (tmp_path / "straight" / "checkpoint-2" / "rollouts_0.pt").is_file()
    GRPOTrainer(folders["qwen2_vl"], names_colour, args=config(tmp_path, "resumed", **common),
                train_dataset=colour_rows()).train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_generation_batch_split_across_steps_and_a_checkpoint_inside_it(tmp_path, folders):
    """steps_per_generation 3 with gradient_accumulation_steps 2: a step takes micro-batches of two generation
    batches (their images joined); a checkpoint at a step inside a batch holds the buffered rows with their images,
    and the resume equals the uninterrupted run."""
    common = dict(max_steps=3, per_device_train_batch_size=4, steps_per_generation=3, gradient_accumulation_steps=2,
                  num_generations=4, lr_scheduler_type="constant", save_strategy="steps", save_steps=1)
    rows12 = colour_rows(12)
    GRPOTrainer(folders["qwen2_5_vl"], names_colour, args=config(tmp_path, "straight", **common),
                train_dataset=rows12).train()
    assert (tmp_path / "straight" / "checkpoint-1" / "experience_0.pt").is_file()
    GRPOTrainer(folders["qwen2_5_vl"], names_colour, args=config(tmp_path, "resumed", **common),
                train_dataset=rows12).train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-1"))
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_text_rows_keep_their_text_in_templates_that_read_parts(tmp_path, folders):
    """SmolVLM's and LLaVA-NeXT's templates read a message's content as a list of parts (a string would be
    dropped): a row without an image is rendered with its text as a text part, as TRL does."""
    rows = [{"prompt": [{"role": "user", "content": "Which colour is this?"}],
             "image": Image.new("RGB", (56, 56), COLOURS["red"]) if i % 2 else None, "answer": "red"}
            for i in range(8)]
    for family in ("smolvlm", "llava_next"):
        trainer = GRPOTrainer(folders[family], names_colour, args=config(tmp_path, family),
                              train_dataset=datasets.Dataset.from_list(rows))
        text = trainer.setup.tokenizer.decode(trainer.setup.prompt_ids[0])
        assert "Which colour is this?" in text, text


def test_assigning_tools_keeps_the_images(tmp_path, folders):
    """trainer.tools = [...] (TRL's way to add tools after construction) encodes the prompts again, images
    included."""
    from helpers import echo

    trainer = GRPOTrainer(folders["qwen3_vl"], names_colour, args=config(tmp_path, max_prompt_length=2048),
                          train_dataset=colour_rows())
    before = trainer.setup.prompt_ids[0]
    trainer.tools = [echo]
    image_pad = trainer.setup.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    after = trainer.setup.prompt_ids[0]
    assert after != before and after.count(image_pad) == before.count(image_pad) > 0
    assert trainer.setup.images is not None and "echo" in trainer.setup.tokenizer.decode(after)


def test_the_processor_is_saved_with_the_model_and_in_checkpoints(tmp_path, folders):
    """output_dir and checkpoint-N load back with AutoProcessor and AutoModelForImageTextToText, and train again."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from grpokit.tiny_vision import video_processor_optional

    args = config(tmp_path, save_strategy="steps", save_steps=1)
    GRPOTrainer(folders["qwen2_5_vl"], names_colour, args=args, train_dataset=colour_rows()).train()
    video_processor_optional()
    for folder in (tmp_path / "out", tmp_path / "out" / "checkpoint-1"):
        processor = AutoProcessor.from_pretrained(folder)
        assert type(processor).__name__ == "Qwen2_5_VLProcessor"
        AutoModelForImageTextToText.from_pretrained(folder)
    GRPOTrainer(str(tmp_path / "out"), names_colour, args=config(tmp_path, "again"),
                train_dataset=colour_rows()).train()
    assert len([r for r in rows_of(tmp_path / "again") if "loss" in r]) == 2


def test_openai_image_url_parts_are_image_parts(tmp_path, folders):
    path = tmp_path / "red.png"
    Image.new("RGB", (56, 56), COLOURS["red"]).save(path)
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(path)}},
                                                    {"type": "text", "text": "Which colour is this?"}]}],
             "answer": "red"}] * 8

    def lowercase(completions, **kwargs):
        return [sum(ch.islower() for ch in c[0]["content"]) / (1 + len(c[0]["content"])) for c in completions]

    trainer = GRPOTrainer(folders["qwen2_5_vl"], lowercase, args=config(tmp_path),
                          train_dataset=datasets.Dataset.from_list(rows))
    assert trainer.setup.prompt_ids[0].count(trainer.setup.tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4
    trainer.train()

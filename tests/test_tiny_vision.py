"""The tiny vision-language fixtures (grpokit/tiny_vision) behave like their families: the shipped chat template
renders an image prompt as the family's checkpoints do, the processor expands the image placeholder into as many
image tokens as the model's config implies, the model's forward, generate and backward run on the processor's
output (gradients reaching the language model and the vision tower), and the saved folder loads back through the
Auto classes and the family's own class with identical logits."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from grpokit.tiny_vision import FAMILIES, save, templates, video_processor_optional

MESSAGES = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
QWEN2_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                "<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n<|im_start|>assistant\n")
# the prompt each family's checkpoints render for MESSAGES (their model cards show the same shapes)
PROMPTS = {
    "qwen2_vl": QWEN2_PROMPT,
    "qwen2_5_vl": QWEN2_PROMPT,
    "qwen3_vl": ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
                 "<|im_start|>assistant\n"),
    "gemma3": "<bos><start_of_turn>user\n<start_of_image>How many?<end_of_turn>\n<start_of_turn>model\n",
    "llava_next": "[INST] <image>\nHow many? [/INST]",
    "smolvlm": "<|im_start|>User:<image>How many?<end_of_utterance>\nAssistant:",
}
# (model class, processor class) per family: a family is skipped only where this transformers lacks them
CLASSES = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLProcessor"),
    "gemma3": ("Gemma3ForConditionalGeneration", "Gemma3Processor"),
    "llava_next": ("LlavaNextForConditionalGeneration", "LlavaNextProcessor"),
    "smolvlm": ("Idefics3ForConditionalGeneration", "Idefics3Processor"),
}
# the tokens that end an assistant turn (generation_config's eos), and what the tokenizer puts in front
STOPS = {"qwen2_vl": ["<|im_end|>", "<|endoftext|>"], "qwen2_5_vl": ["<|im_end|>", "<|endoftext|>"],
         "qwen3_vl": ["<|im_end|>", "<|endoftext|>"], "gemma3": ["<eos>", "<end_of_turn>"], "llava_next": ["</s>"],
         "smolvlm": ["<end_of_utterance>"]}
ADDED_BOS = {"gemma3": "<bos>", "llava_next": "<s>"}
VISION = ("visual.", "vision_tower.", "vision_model.")
LANGUAGE = ("language_model.", "text_model.")


def picture(width: int = 56, height: int = 56, seed: int = 0) -> Image.Image:
    """An RGB image of random pixels (a flat colour would give every patch the same features)."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def available(name: str) -> None:
    missing = [c for c in CLASSES[name] if not hasattr(transformers, c)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(name, model, processor, inputs for MESSAGES with one 56x56 image)."""
    available(request.param)
    model, processor = FAMILIES[request.param]()
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    inputs = processor(text=[text], images=[picture()], return_tensors="pt")
    return request.param, model, processor, inputs


def image_token_id(config) -> int:
    return config.image_token_id if hasattr(config, "image_token_id") else config.image_token_index


def expected_image_tokens(name: str, config, inputs) -> int:
    """How many image tokens one 56x56 image is, from the model's config (and, where the image's split into
    patches or tiles is the processor's to choose, its grid)."""
    vision = config.vision_config
    if name.startswith("qwen"):  # one token per merge x merge block of patches
        grid = inputs["image_grid_thw"]
        assert grid.tolist() == [[1, 4, 4]]  # 56 -> 4x4 patches of 14; Qwen3-VL: 56 -> 64 -> 4x4 patches of 16
        return int(grid.prod()) // vision.spatial_merge_size**2
    if name == "gemma3":  # the tower's patches average-pooled to a fixed count
        return config.mm_tokens_per_image
    side = vision.image_size // vision.patch_size
    if name == "llava_next":  # base image + a 2x2 grid of tiles (2*side features a row) + a newline per row
        return side**2 + (2 * side) ** 2 + 2 * side
    # smolvlm: each tile's patches pixel-shuffled by scale_factor, times the tiles (a 2x2 split plus the global one)
    assert inputs["pixel_values"].shape[:2] == (1, 5)
    return 5 * side**2 // config.scale_factor**2


def test_templates_are_the_ones_trl_checks_against_the_hub():
    trl = Path(importlib.util.find_spec("trl").origin).parent / "chat_templates"
    for name, filename in templates.TRL_FILES.items():
        assert getattr(templates, name) == (trl / filename).read_text(encoding="utf-8"), name


def test_the_template_renders_the_family_prompt(family):
    name, model, processor, inputs = family
    assert processor.apply_chat_template(MESSAGES, add_generation_prompt=True) == PROMPTS[name]
    assert type(processor).__name__ == CLASSES[name][1] and type(model).__name__ == CLASSES[name][0]
    tok = processor.tokenizer
    assert len(tok) == model.config.get_text_config().vocab_size
    assert [tok.convert_ids_to_tokens(i) for i in model.generation_config.eos_token_id] == STOPS[name]
    assert tok.eos_token == STOPS[name][0]
    first = tok.convert_ids_to_tokens(int(inputs["input_ids"][0, 0]))
    assert first == ADDED_BOS.get(name, PROMPTS[name][:len(first)])  # Gemma 3: <bos> twice, as the checkpoints do


def test_the_image_placeholder_expands_as_the_config_says(family):
    name, model, processor, inputs = family
    ids = inputs["input_ids"][0]
    count = int((ids == image_token_id(model.config)).sum())
    assert count == expected_image_tokens(name, model.config, inputs) > 1
    positions = (ids == image_token_id(model.config)).nonzero().flatten()
    if name != "smolvlm":  # one contiguous run (SmolVLM interleaves tile tags)
        assert positions[-1] - positions[0] + 1 == count
    token = processor.tokenizer.convert_ids_to_tokens(image_token_id(model.config))
    assert processor.tokenizer.decode(ids).count(token) == count  # (Gemma3Processor.image_token is <start_of_image>)


def test_forward_gives_finite_logits_over_the_vocabulary(family):
    name, model, processor, inputs = family
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], len(processor.tokenizer))
    assert torch.isfinite(logits).all()
    other = processor(text=[PROMPTS[name]], images=[picture(seed=1)], return_tensors="pt")
    with torch.no_grad():
        assert not torch.allclose(model(**other).logits[0, -1], logits[0, -1])  # the image is read


def test_generate_with_the_image_produces_tokens(family):
    _name, model, processor, inputs = family
    prompt_length = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    new = out[0, prompt_length:]
    assert new.numel() == 6 and int(new.max()) < len(processor.tokenizer)
    assert torch.equal(out[0, :prompt_length], inputs["input_ids"][0])
    with torch.no_grad():  # the first greedy token is the forward's argmax
        assert int(new[0]) == int(model(**inputs).logits[0, -1].argmax())


def test_backward_reaches_the_language_model_and_the_vision_tower(family):
    name = family[0]
    model, processor = FAMILIES[name]()
    model.train()
    text = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    inputs = processor(text=[text], images=[picture()], return_tensors="pt")
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    unused = sorted(n for n, g in grads.items() if g is None)
    # LLaVA-NeXT reads the second-last CLIP layer: the last one and the post-layernorm get no gradient (as in the
    # real model: DDP needs find_unused_parameters); every other parameter of every family gets one
    assert unused == sorted(n for n in grads if name == "llava_next" and (
        "vision_tower.encoder.layers.1." in n or "post_layernorm" in n))
    for group in (VISION, LANGUAGE):
        mine = {n: g for n, g in grads.items() if g is not None and any(part in n for part in group)}
        assert mine and all(torch.isfinite(g).all() for g in mine.values()), group
        assert sum(int(g.abs().sum() > 0) for g in mine.values()) > len(mine) // 2, group


def test_a_batch_of_prompts_with_different_images(family):
    name, model, processor, _ = family
    images = [picture(56, 56), picture(84, 56, seed=2)]
    singles = [processor(text=[PROMPTS[name]], images=[image], return_tensors="pt") for image in images]
    batch = processor(text=[PROMPTS[name]] * 2, images=[[image] for image in images], padding=True,
                      padding_side="left", return_tensors="pt")
    token = image_token_id(model.config)
    assert (batch["input_ids"] == token).sum(1).tolist() == [int((s["input_ids"] == token).sum()) for s in singles]
    with torch.no_grad():
        logits = model(**batch).logits
        alone = model(**singles[1]).logits
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(logits[1, -1], alone[0, -1], atol=1e-4, rtol=1e-4)  # the unpadded row: same logits


def test_the_saved_folder_loads_back_with_identical_logits(family, tmp_path, monkeypatch):
    name, model, processor, inputs = family
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = save(model, processor, tmp_path / name)
    video_processor_optional()  # what a process that only loads a Qwen folder does where torchvision is missing
    loaded = AutoProcessor.from_pretrained(folder)
    assert type(loaded) is type(processor) and type(loaded.image_processor) is type(processor.image_processor)
    assert loaded.apply_chat_template(MESSAGES, add_generation_prompt=True) == PROMPTS[name]
    again = loaded(text=[PROMPTS[name]], images=[picture()], return_tensors="pt")
    assert again.keys() == inputs.keys() and all(torch.equal(again[k], inputs[k]) for k in inputs)
    with torch.no_grad():
        reference = model(**inputs).logits
        for cls in (AutoModelForImageTextToText, getattr(transformers, CLASSES[name][0])):
            reloaded = cls.from_pretrained(folder).eval()
            assert type(reloaded) is type(model)
            assert torch.equal(reloaded(**again).logits, reference)
    assert reloaded.generation_config.eos_token_id == model.generation_config.eos_token_id


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_seed_gives_the_same_model_and_leaves_the_global_rng_alone(name):
    available(name)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, _ = FAMILIES[name](seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    second, _ = FAMILIES[name](seed=3)
    third, _ = FAMILIES[name](seed=4)
    a, b, c = (dict(m.named_parameters()) for m in (first, second, third))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def prompt_and_completion(model, processor, inputs, completion: str):
    """The prompt's inputs with `completion` appended (per-token fields padded with 0: text), and its ids."""
    ids = torch.tensor([processor.tokenizer.convert_tokens_to_ids(list(completion))])
    full = dict(inputs, input_ids=torch.cat([inputs["input_ids"], ids], 1))
    full["attention_mask"] = torch.ones_like(full["input_ids"])
    for key in ("mm_token_type_ids", "token_type_ids"):
        if key in full:
            full[key] = torch.cat([inputs[key], torch.zeros_like(ids)], 1)
    return full, ids


def test_a_prefill_then_completion_only_forwards_equal_the_full_forward(family):
    """The recipe docs/vision-notes.md gives: prefill the prompt with its images into a KV cache, then forward
    completion tokens alone with that cache: Qwen with explicit 3-D positions (text positions + the prefill's
    rope_deltas; a full-length attention_mask there crashes in transformers 5.19), the others with the attention
    mask over cache + new tokens."""
    name, model, processor, inputs = family
    full, completion = prompt_and_completion(model, processor, inputs, "abcde")
    length = inputs["input_ids"].shape[1]
    with torch.no_grad():
        reference = model(**full).logits[:, length:]
        cache = model(**inputs, use_cache=True).past_key_values
        if name.startswith("qwen"):
            positions = (torch.arange(length, length + 5)[None] + model.model.rope_deltas).expand(3, 1, -1)
            step = model(input_ids=completion, past_key_values=cache, position_ids=positions)
        else:
            step = model(input_ids=completion, attention_mask=full["attention_mask"], past_key_values=cache)
    torch.testing.assert_close(step.logits, reference, atol=1e-5, rtol=1e-5)


def test_plain_1d_positions_are_right_except_for_qwens_mrope(family):
    name, model, processor, inputs = family
    full, _ = prompt_and_completion(model, processor, inputs, "abcde")
    with torch.no_grad():
        reference = model(**full).logits
        plain = model(**full, position_ids=torch.arange(full["input_ids"].shape[1])[None]).logits
    if name.startswith("qwen"):  # image tokens sit on a (t, h, w) grid: arange positions are different ones
        assert not torch.allclose(plain, reference, atol=1e-5)
    else:
        torch.testing.assert_close(plain, reference, atol=1e-6, rtol=1e-6)


# what the family's get_image_features takes besides pixel_values
IMAGE_FEATURE_KEYS = {"qwen2_vl": ("image_grid_thw",), "qwen2_5_vl": ("image_grid_thw",),
                      "qwen3_vl": ("image_grid_thw",), "gemma3": (), "llava_next": ("image_sizes",),
                      "smolvlm": ("pixel_attention_mask",)}


def test_image_features_computed_once_stand_in_for_the_pixels(family):
    """model.model.get_image_features(...) once, then forwards with mm_encoder_outputs={"image": ...} and no
    pixel_values: the hook for encoding each image once per pass (docs/vision-notes.md)."""
    name, model, processor, _ = family
    batch = dict(processor(text=[PROMPTS[name]] * 2, images=[[picture()], [picture(84, 56, seed=2)]],
                           padding=True, padding_side="left", return_tensors="pt"))
    with torch.no_grad():
        reference = model(**batch).logits
        features = model.model.get_image_features(
            batch["pixel_values"], **{k: batch[k] for k in IMAGE_FEATURE_KEYS[name]}, return_dict=True)
        rest = {k: v for k, v in batch.items() if k != "pixel_values"}
        assert torch.equal(model(**rest, mm_encoder_outputs={"image": features}).logits, reference)

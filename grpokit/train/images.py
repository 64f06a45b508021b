"""Image prompts at the trainer's edge: whether a run has them, its processor, and each row's prompt encoded.

    processor = vision_processor(args, config, model, processing_class, datasets_, agentic)   # None: text run
    ids = prompt_ids(processor, tokenizer, dataset, where, kwargs, max_prompt_length)    # every row, checked
    visions = PromptImages(processor, kwargs).of(dataset, rows)                         # PromptVision per row

A row's images are decoded and its prompt encoded up front (every bad image or count named by row before any model
loads), keeping the ids only; the processor's tensors are made again when the row is drawn for a batch, so a
large dataset's pixels never sit in memory at once.
"""

from __future__ import annotations

from typing import Any

from grpokit.config import ConfigError
from grpokit.data import is_conversational, render_prompt
from grpokit.models.loading import is_vision_language
from grpokit.vision import ImageError, PromptVision, encode_prompt, row_images, with_image_parts
from grpokit.vision.images import IMAGE_COLUMNS
from grpokit.vision.processor import load_processor


def has_images(datasets_: list) -> str | None:
    """What in the datasets holds images (an image column, an image part in a prompt), or None."""
    for ds in datasets_:
        for column in IMAGE_COLUMNS:
            if column in (ds.column_names or ()) and holds_values(ds, column):
                return f"the dataset column {column!r}"
        row = first_image_part(ds)
        if row is not None:
            return f"an image part in prompt {row}"
    return None


def holds_values(dataset, column: str) -> bool:
    """Some row of `column` has an image (TRL: None, or an empty list, in every row means no images), read from
    the Arrow table without decoding any image."""
    import pyarrow.compute as pc

    values = dataset.data.column(column)
    if values.null_count == len(values):
        return False
    if column == "images" and hasattr(values.type, "value_type"):
        return bool(pc.max(pc.list_value_length(values)).as_py() or 0)
    return True


def first_image_part(dataset, rows: int = 64) -> int | None:
    """The first of the dataset's first `rows` rows whose conversational prompt has an image content part."""
    if "prompt" not in (dataset.column_names or ()):
        return None
    for row, prompt in enumerate(dataset.select(range(min(rows, len(dataset))))["prompt"]):
        messages = prompt if isinstance(prompt, list) else []
        if any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(part, dict) and part.get("type") == "image" for part in m["content"])
               for m in messages):
            return row
    return None


def vision_processor(args, config, model, processing_class, datasets_: list):
    """The run's processor when it trains a vision-language model (processing_class when it is one, else
    AutoProcessor beside the model), None for a text run; every mismatch refused up front."""
    images = has_images(datasets_)
    vlm = is_vision_language(config)
    given = getattr(processing_class, "image_processor", None) is not None
    if images and not vlm:
        kind = "an unreadable config" if config is None else f"a text-only {config.model_type} model"
        raise ConfigError(
            f"This run has images ({images}) but the model is {kind}: images need a vision-language model "
            "(e.g. Qwen2.5-VL, Gemma 3, LLaVA-NeXT, SmolVLM) and its processor. Drop the image column and image "
            "parts to train on the text alone.")
    if given and not vlm:
        raise ConfigError(f"processing_class is a {type(processing_class).__name__} (a processor with an image "
                          "processor) but the model is not a vision-language model; pass the model's tokenizer.")
    if not vlm:
        return None
    check_transformers()
    if images and args.rollout_engine not in ("local", None):
        raise ConfigError(
            f"rollout_engine={args.rollout_engine!r} with image prompts is not supported yet: use "
            "rollout_engine='local' (grpokit's decode loop encodes each prompt's images once per group).")
    if processing_class is not None and not given:
        if images:
            raise ConfigError(
                f"The model is a {config.model_type} vision-language model and the prompts have images, but "
                f"processing_class is a {type(processing_class).__name__} without an image processor; pass the "
                "model's processor (AutoProcessor.from_pretrained(...)) or leave processing_class out.")
        return None  # a vision-language model trained on text with its tokenizer
    return processing_class if given else load_processor(model, args.trust_remote_code)


VISION_TRANSFORMERS = (5, 0)  # mm_token_type_ids and get_rope_index(..., mm_token_type_ids) arrived with 5.0


def check_transformers() -> None:
    """Vision-language runs read transformers 5's processor outputs and positions API (tested on 5.19)."""
    import transformers

    installed = tuple(int(part) for part in transformers.__version__.split(".")[:2] if part.isdigit())
    if installed < VISION_TRANSFORMERS:
        raise ConfigError(
            f"Vision-language training needs transformers>=5.0 (its processors' mm_token_type_ids and the Qwen "
            f"families' get_rope_index signature; tested with 5.19), and transformers {transformers.__version__} is "
            "installed: pip install -U 'transformers>=5'.")


def row_messages(dataset, row: int, where: str) -> tuple[Any, list]:
    """The row's prompt and its decoded images."""
    record = dataset[row]
    try:
        return record["prompt"], row_images(record, where)
    except ImageError as exc:
        raise ConfigError(str(exc)) from exc


def encode_row(processor, tokenizer, dataset, row: int, where: str, kwargs: dict
               ) -> tuple[list[int], PromptVision | None]:
    """One row's prompt ids and images. A prompt without images is rendered as on a text run (a string as it is,
    messages with the chat template); with images, TRL's message rule, then the processor's chat template."""
    prompt, images = row_messages(dataset, row, where)
    if not images and (isinstance(prompt, str) or first_image_part_of(prompt) is None):
        text = render_prompt(getattr(processor, "tokenizer", tokenizer), prompt, kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None
    if not (isinstance(prompt, str) or is_conversational(prompt)):
        raise ConfigError(f"{where}: a prompt must be a string or a list of {{'role', 'content'}} messages, got "
                          f"{type(prompt).__name__}.")
    try:
        messages = with_image_parts(prompt, images, where)
        return encode_prompt(processor, messages, kwargs)
    except (ImageError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)) from exc


def first_image_part_of(prompt) -> int | None:
    return next((k for k, m in enumerate(prompt if isinstance(prompt, list) else [])
                 if isinstance(m, dict) and isinstance(m.get("content"), list)
                 and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])), None)


class PromptImages:
    """Each drawn row's PromptVision, made again from the dataset (the same ids as up front); the last batch's
    kept, so a row drawn again soon (its G completions, an evaluation) is not processed twice."""

    def __init__(self, processor, tokenizer, kwargs: dict) -> None:
        self.processor, self.tokenizer, self.kwargs = processor, tokenizer, kwargs
        self.kept: dict = {}

    def of(self, dataset, rows: list[int], where: str = "train_dataset") -> list[PromptVision | None]:
        kept, self.kept = self.kept, {}
        out = []
        for row in rows:
            key = (id(dataset), row)
            if key not in kept:
                kept[key] = encode_row(self.processor, self.tokenizer, dataset, row, f"{where} row {row}",
                                       self.kwargs)[1]
            self.kept[key] = kept[key]
            out.append(kept[key])
        return out


# the submodule that holds a vision-language model's image encoder, by family (Qwen: `visual`; Gemma 3, LLaVA:
# `vision_tower`; Idefics3 / SmolVLM: `vision_model`)
TOWER_NAMES = ("visual", "vision_tower", "vision_model")
TOWER_PATTERN = r".*\b(" + "|".join(TOWER_NAMES) + r")\b.*"


def tower_parameters(model) -> list:
    """(name, parameter) pairs of the model's vision tower."""
    return [(n, p) for n, p in model.named_parameters() if any(part in TOWER_NAMES for part in n.split("."))]


def place_adapter(peft_config, freeze_vision_tower: bool | None):
    """The LoraConfig a vision-language model is wrapped with: the tower excluded (exclude_modules) unless
    freeze_vision_tower is False or the user set exclude_modules. Returns the config (a copy when changed)."""
    if freeze_vision_tower is False or getattr(peft_config, "exclude_modules", None):
        return peft_config
    if not hasattr(peft_config, "exclude_modules"):
        raise ConfigError(f"{type(peft_config).__name__} has no exclude_modules (peft < 0.14): upgrade peft, or set "
                          "freeze_vision_tower=False to place the adapter's target modules in the vision tower too.")
    import copy

    placed = copy.copy(peft_config)
    placed.exclude_modules = TOWER_PATTERN
    return placed


def freeze_tower(model) -> int:
    """The vision tower's parameters frozen; how many."""
    frozen = tower_parameters(model)
    for _, parameter in frozen:
        parameter.requires_grad_(False)
    return len(frozen)

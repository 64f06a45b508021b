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
from grpokit.data import is_conversational
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
    the Arrow table (after select / filter / shuffle) without decoding any image."""
    import pyarrow.compute as pc

    values = arrow_column(dataset, column)
    if values.null_count == len(values):
        return False
    if column == "images" and hasattr(values.type, "value_type"):
        return bool(pc.max(pc.list_value_length(values)).as_py() or 0)
    return True


def arrow_column(dataset, column: str):
    """The column as Arrow holds it, through select / filter / shuffle indices, nothing decoded."""
    return dataset.select_columns([column]).with_format("arrow")[:][column]


def first_image_part(dataset) -> int | None:
    """The first row whose conversational prompt has an image content part."""
    if "prompt" not in (dataset.column_names or ()):
        return None
    for row, prompt in enumerate(dataset["prompt"]):
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
    if images:
        check_sharded_images(args, datasets_)
    if images and args.resolved_rollout_engine != "local":
        raise ConfigError(
            f"rollout_engine={args.resolved_rollout_engine!r} (use_vllm={args.use_vllm}) with image prompts is not "
            "supported yet: use the local engine (rollout_engine='local', use_vllm=False), whose decode loop encodes "
            "each prompt's images once per group.")
    if given:
        check_processor(processing_class, config)
    if processing_class is not None and not given:
        if images:
            raise ConfigError(
                f"The model is a {config.model_type} vision-language model and the prompts have images, but "
                f"processing_class is a {type(processing_class).__name__} without an image processor; pass the "
                "model's processor (AutoProcessor.from_pretrained(...)) or leave processing_class out.")
        return None  # a vision-language model trained on text with its tokenizer
    return processing_class if given else load_processor(model, args.trust_remote_code)


def check_sharded_images(args, datasets_: list) -> None:
    """Under FSDP2 every process must run the vision tower's units in the same forwards (their gathers are
    collectives): a dataset where some rows have no image could leave one process without images in a forward
    while the others gather the tower, and the run would hang. Such datasets are refused under FSDP2."""
    import os

    from grpokit.config.fsdp import fsdp_options

    if fsdp_options(args.fsdp, args.fsdp_config, os.environ) is None:
        return
    for ds in datasets_:
        for column in IMAGE_COLUMNS:
            if column in (ds.column_names or ()) and not every_row_has_images(ds, column):
                raise ConfigError(
                    f"FSDP with image prompts needs an image in every row, and the dataset column {column!r} has rows "
                    "without one: a process whose batch holds no image would skip the vision tower's gathers that "
                    "the others make. Drop the rows without images (dataset.filter(...)), or train them in a run "
                    "of their own, or use DDP.")


def every_row_has_images(dataset, column: str) -> bool:
    """No row of `column` is None (or, for `images`, an empty list): read from Arrow, nothing decoded."""
    import pyarrow.compute as pc

    values = arrow_column(dataset, column)
    if values.null_count:
        return False
    if column == "images" and hasattr(values.type, "value_type"):
        return bool(pc.min(pc.list_value_length(values)).as_py())
    return True


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


def encode_row(processor, tokenizer, dataset, row: int, where: str, kwargs_for) -> tuple[list[int], Any]:
    """One row's prompt ids and PromptVision (None without images); kwargs_for(environment name or None): the
    chat template's keyword arguments for the row (its environment's tool schemas)."""
    record = dataset[row]
    try:
        images = row_images(record, where)
    except ImageError as exc:
        raise ConfigError(str(exc)) from exc
    return encode_messages(processor, tokenizer, record["prompt"], images, where,
                           kwargs_for(record.get("environment")))


def encode_messages(processor, tokenizer, prompt, images: list, where: str, kwargs: dict
                    ) -> tuple[list[int], Any]:
    """A prompt and its images as ids and PromptVision. A plain string without images stays text (as on a text
    run); everything else becomes messages with content parts (TRL's rule: string contents become text parts, which
    every family's template reads) through the processor's chat template."""
    if isinstance(prompt, str) and not images:
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), None
    if not (isinstance(prompt, str) or is_conversational(prompt)):
        raise ConfigError(f"{where}: a prompt must be a string or a list of {{'role', 'content'}} messages, got "
                          f"{type(prompt).__name__}.")
    try:
        messages = with_image_parts(prompt, images, where)
    except (ImageError, ValueError) as exc:
        raise ConfigError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from exc
    try:
        ids, vision = encode_prompt(processor, messages, kwargs)
    except Exception as exc:  # the processor's chat template or image processor on this row
        raise ConfigError(f"{where}: the processor could not encode the prompt ({type(exc).__name__}: {exc}); its "
                          "chat template may not accept image parts where this prompt has them (a system or "
                          "assistant message): put the images in a user message.") from exc
    check_image_tokens(processor, ids, vision, where)
    return ids, vision


def check_image_tokens(processor, ids: list[int], vision, where: str) -> None:
    """The encoded prompt holds tokens for its images: a template that drops image parts (in a system message,
    say) would leave the model features with nowhere to go, a crash deep in the first forward."""
    if vision is None:
        return
    marked = [int(field.sum()) for field in vision.token_fields.values()]
    token = getattr(processor, "image_token_id", None)
    if (marked and min(marked) == 0) or (not marked and token is not None and ids.count(token) < vision.num_images):
        raise ConfigError(
            f"{where}: the prompt has {vision.num_images} image(s) but its encoded ids hold no image token for them: "
            "the chat template drops image parts where this prompt has them (a system or assistant message?), or "
            "the processor is not this model's. Put the images in a user message, and pass the model's processor.")


def check_processor(processor, config) -> None:
    """The processor fills the model's own image token (a processor of another family fills another). Gemma 3's
    processor names its <start_of_image> placeholder as its image token, not the token the model fills: skipped."""
    wanted = getattr(config, "image_token_id", None)
    wanted = getattr(config, "image_token_index", None) if wanted is None else wanted
    fills = getattr(processor, "image_token_id", None)
    if config.model_type == "gemma3" or wanted is None or fills is None or fills == wanted:
        return
    raise ConfigError(f"processing_class is a {type(processor).__name__} whose image token (id {fills}) is not the "
                      f"model's (a {config.model_type} model: id {wanted}): pass the model's own processor.")


class PromptImages:
    """Each drawn row's PromptVision, made again from the dataset (the same ids as up front); the last batch's
    kept, so a row drawn again soon (its G completions, an evaluation) is not processed twice. kwargs_for: the
    chat template's keyword arguments for a row's environment (None: no environment)."""

    def __init__(self, processor, tokenizer, kwargs_for) -> None:
        self.processor, self.tokenizer, self.kwargs_for = processor, tokenizer, kwargs_for
        self.kept: dict = {}

    def of(self, dataset, rows: list[int], where: str = "train_dataset") -> list[PromptVision | None]:
        kept, self.kept = self.kept, {}
        out = []
        for row in rows:
            key = (id(dataset), row)
            if key not in kept or kept[key][0] is not dataset:  # an id reused by another (temporary) dataset
                kept[key] = (dataset, encode_row(self.processor, self.tokenizer, dataset, row, f"{where} row {row}",
                                                 self.kwargs_for)[1])
            self.kept[key] = kept[key]
            out.append(kept[key][1])
        return out

    def extended(self, prompt, record: dict, kwargs: dict, where: str) -> tuple[list[int], PromptVision | None]:
        """A prompt reset() extended, with its row's images, through the processor."""
        try:
            images = row_images(record, where)
        except ImageError as exc:
            raise ConfigError(str(exc)) from exc
        return encode_messages(self.processor, self.tokenizer, prompt, images, where, kwargs)


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

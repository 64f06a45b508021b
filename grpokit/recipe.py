"""The keys of TRL's and open-r1's training scripts in a `grpo train` YAML.

TRL's `trl grpo` and open-r1's `grpo.py` read one YAML that mixes GRPOConfig options with their script's own
arguments (ScriptArguments, ModelConfig, open-r1's GRPOScriptArguments). `grpo train` reads such a recipe
unchanged: `recipe_run` turns the script keys into grpokit's run keys, `prepare_dataset` and `peft_config` apply
the rest, and `grpo train` sets `chat_template` on the tokenizer. Each key means what it means in those scripts:

    model_name_or_path                   -> model
    model_revision, torch_dtype / dtype,
    attn_implementation                  -> model_init_kwargs {revision, dtype, attn_implementation}; a
                                            flash-attention implementation without CUDA and flash_attn installed
                                            falls back to sdpa, with a warning
    dataset_name, dataset_config,
    dataset_train_split [train]          -> dataset {path, name, split}
    dataset_test_split                   -> eval_dataset, when eval_strategy is not "no"
    dataset_prompt_column [prompt]       -> that column is the prompt
    system_prompt                        -> with dataset_prompt_column or system_prompt, each prompt becomes the
                                            chat [system (if given), user: the prompt column], as open-r1 does
    use_peft, lora_r [16], lora_alpha [32],
    lora_dropout [0.05], lora_target_modules,
    lora_task_type [CAUSAL_LM]           -> a peft LoraConfig
    chat_template                        -> the tokenizer's chat template

A key given both ways (model and model_name_or_path) is an error.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import datasets

from grpokit.config import ConfigError

logger = logging.getLogger("grpokit")

MODEL_INIT_KEYS = {"model_revision": "revision", "torch_dtype": "dtype", "dtype": "dtype",
                   "attn_implementation": "attn_implementation"}
DATASET_KEYS = ("dataset_name", "dataset_config", "dataset_train_split", "dataset_test_split")
PROMPT_KEYS = ("dataset_prompt_column", "system_prompt")
PEFT_KEYS = {"use_peft": False, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": None,
             "lora_task_type": "CAUSAL_LM"}
OTHER_KEYS = ("model_name_or_path", "chat_template")
RECIPE_KEYS = (*MODEL_INIT_KEYS, *DATASET_KEYS, *PROMPT_KEYS, *PEFT_KEYS, *OTHER_KEYS)


def recipe_run(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a YAML's values into (values with the script keys translated, the script keys themselves)."""
    recipe = {key: values.pop(key) for key in list(values) if key in RECIPE_KEYS}
    if "model_name_or_path" in recipe:
        _set_once(values, "model", recipe["model_name_or_path"], "model_name_or_path")
    init = {MODEL_INIT_KEYS[key]: recipe[key] for key in MODEL_INIT_KEYS if recipe.get(key) is not None}
    if init.get("attn_implementation", "").startswith("flash_attention") and not _flash_attention_available():
        logger.warning("attn_implementation=%s needs CUDA and the flash_attn package; using sdpa instead.",
                       init["attn_implementation"])
        init["attn_implementation"] = "sdpa"
    if init:
        values["model_init_kwargs"] = {**init, **dict(values.get("model_init_kwargs") or {})}
    if recipe.get("dataset_name") is not None:
        source = {"path": recipe["dataset_name"], "split": recipe.get("dataset_train_split") or "train"}
        if recipe.get("dataset_config") is not None:
            source["name"] = recipe["dataset_config"]
        _set_once(values, "dataset", source, "dataset_name")
        wants_eval = str(values.get("eval_strategy", "no")).lower() != "no"
        if recipe.get("dataset_test_split") and wants_eval and "eval_dataset" not in values:
            values["eval_dataset"] = {**source, "split": recipe["dataset_test_split"]}
    return values, recipe


def _set_once(values: dict[str, Any], key: str, value: Any, script_key: str) -> None:
    if key in values:
        raise ConfigError(f"The config gives both {key!r} and {script_key!r}; keep one of them.")
    values[key] = value


def _flash_attention_available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def prepare_dataset(dataset: datasets.Dataset | None, recipe: dict[str, Any]) -> datasets.Dataset | None:
    """open-r1's make_conversation: the prompt column as a user message after the system prompt (if any)."""
    if dataset is None or not any(recipe.get(key) is not None for key in PROMPT_KEYS):
        return dataset
    column = recipe.get("dataset_prompt_column") or "prompt"
    if column not in dataset.column_names:
        raise ConfigError(f"dataset_prompt_column={column!r} is not a column of the dataset (columns: "
                          f"{dataset.column_names}).")
    if len(dataset) and not isinstance(dataset[0][column], str):
        kind = type(dataset[0][column]).__name__
        raise ConfigError(f"dataset_prompt_column={column!r} holds {kind}s, not text, so it cannot become the user "
                          "message; name a text column (a reasoning_gym dataset's is 'question').")
    system = recipe.get("system_prompt")

    def conversation(row: dict[str, Any]) -> dict[str, Any]:
        messages = [{"role": "system", "content": system}] if system else []
        return {"prompt": messages + [{"role": "user", "content": row[column]}]}

    return dataset.map(conversation, remove_columns=["prompt"] if "prompt" in dataset.column_names else None)


def peft_config(recipe: dict[str, Any]):
    """A LoraConfig when use_peft is true (TRL ModelConfig's defaults), else None."""
    if not recipe.get("use_peft"):
        stray = sorted(key for key in PEFT_KEYS if key != "use_peft" and key in recipe)
        if stray:
            raise ConfigError(f"{', '.join(stray)} given without use_peft: true; add use_peft: true to train a "
                              "LoRA adapter, or remove them.")
        return None
    from peft import LoraConfig

    options = {key: recipe.get(key, default) for key, default in PEFT_KEYS.items()}
    return LoraConfig(r=options["lora_r"], lora_alpha=options["lora_alpha"], lora_dropout=options["lora_dropout"],
                      target_modules=options["lora_target_modules"], task_type=options["lora_task_type"])

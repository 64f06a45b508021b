"""FSDP2 options in the forms TRL and accelerate users already write them -> one `FSDPOptions` value.

Sources, as under TRL (transformers' TrainingArguments and accelerate's FSDP plugin):

- GRPOConfig's `fsdp`: True, "full_shard auto_wrap", ["shard_grad_op", "offload"], ... (TrainingArguments' forms);
- GRPOConfig's `fsdp_config`: a mapping, its JSON text or a JSON file's path, keys with or without "fsdp_";
- the environment `accelerate launch --config_file fsdp2.yaml` sets for its workers (ACCELERATE_USE_FSDP,
  FSDP_VERSION, FSDP_RESHARD_AFTER_FORWARD, FSDP_OFFLOAD_PARAMS, FSDP_ACTIVATION_CHECKPOINTING, ...).

Sharding is on when `fsdp` asks for it or accelerate's environment does; `fsdp_config` tunes it (its keys win over
the environment's). Only FSDP2 exists here (`fully_shard`): FSDP1-only strategies (hybrid_shard, no_shard) and
version 1 are refused, FSDP1-only tuning keys (backward_prefetch, use_orig_params, ...) are ignored as accelerate
ignores them under FSDP2. DeepSpeed is refused before the model loads with its FSDP2 equivalent (DEEPSPEED_ADVICE):
DeepSpeed is not installed with grpokit. No torch import here: the config checks use this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpokit.errors import ConfigError


@dataclass(frozen=True)
class FSDPOptions:
    """How the models are sharded with `fully_shard` (grpokit/train/fsdp.py).

    reshard_after_forward: free each layer's gathered weights after its forward (full_shard, ZeRO-3: each layer
    gathered for the forward and again for the backward of every micro-batch); False keeps every layer gathered
    through the whole optimizer step, gathered once per step (shard_grad_op, ZeRO-2: less communication, the whole
    model's weights held during the step, and shared prompts forwarded once in the training pass). offload_params: sharded
    parameters, gradients and optimizer state live in CPU memory (CPUOffloadPolicy; nothing to move on a CPU).
    activation_checkpointing: recompute each decoder layer in the backward. wrap_classes: the module class names
    sharded one unit each (default: the model's `_no_split_modules`, its decoder layers).
    cpu_ram_efficient_loading: process 0's weights are copied into every process's shards once sharded (under
    accelerate's environment transformers loads the real weights on each machine's first process only, zeros
    elsewhere)."""

    reshard_after_forward: bool = True
    offload_params: bool = False
    activation_checkpointing: bool = False
    wrap_classes: tuple[str, ...] = ()
    cpu_ram_efficient_loading: bool = False


DEEPSPEED_ADVICE = (
    "DeepSpeed is not installed with grpokit; shard with FSDP2 instead, which shards the same state: ZeRO-3 -> "
    "fsdp='full_shard auto_wrap' (fsdp_config reshard_after_forward: true), ZeRO-2 -> fsdp='shard_grad_op auto_wrap' "
    "(reshard_after_forward: false), offload_param / offload_optimizer -> add 'offload' (offload_params: true); "
    "with accelerate, launch with an FSDP config file (distributed_type: FSDP, fsdp_version: 2) in place of the "
    "DeepSpeed one (docs/distributed.md)"
)

# TrainingArguments' `fsdp` words -> fsdp_config entries (auto_wrap: the decoder layers are always wrapped)
_WORDS: dict[str, dict[str, Any]] = {
    "full_shard": {"reshard_after_forward": True}, "shard_grad_op": {"reshard_after_forward": False},
    "offload": {"offload_params": True}, "auto_wrap": {},
}
_FSDP1_WORDS = ("no_shard", "hybrid_shard", "hybrid_shard_zero2")
_BOOL_KEYS = ("reshard_after_forward", "offload_params", "activation_checkpointing", "cpu_ram_efficient_loading")
# FSDP1 tuning that FSDP2 has no use for (accelerate ignores it under FSDP2 too)
_FSDP1_KEYS = ("backward_prefetch", "forward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers")
# accepted, and change nothing here: checkpoints are written consolidated (state_dict_type), every decoder layer is
# a unit (min_num_params), no XLA
_NOTED_KEYS = ("state_dict_type", "min_num_params", "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt")
_KEYS = ("version", "cpu_offload", "transformer_layer_cls_to_wrap", "auto_wrap_policy",
         "activation_checkpointing_offload", *_BOOL_KEYS, *_FSDP1_KEYS, *_NOTED_KEYS)
# accelerate's environment variable -> fsdp_config key
_ENVIRONMENT = {
    "FSDP_VERSION": "version", "FSDP_RESHARD_AFTER_FORWARD": "reshard_after_forward",
    "FSDP_OFFLOAD_PARAMS": "offload_params", "FSDP_ACTIVATION_CHECKPOINTING": "activation_checkpointing",
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activation_checkpointing_offload",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "transformer_layer_cls_to_wrap", "FSDP_AUTO_WRAP_POLICY": "auto_wrap_policy",
    "FSDP_STATE_DICT_TYPE": "state_dict_type", "FSDP_CPU_RAM_EFFICIENT_LOADING": "cpu_ram_efficient_loading",
    "FSDP_MIN_NUM_PARAMS": "min_num_params",
}


def fsdp_words(fsdp: Any) -> list[str] | None:
    """`fsdp` as a list of words, None when it asks for no sharding (None, False, "", [])."""
    if isinstance(fsdp, str) and fsdp.lower() in ("true", "false"):  # a command line's --fsdp true
        fsdp = fsdp.lower() == "true"
    if fsdp is None or fsdp is False or fsdp == "" or fsdp == []:
        return None
    if fsdp is True:
        return []
    if isinstance(fsdp, str):
        return fsdp.split()
    if isinstance(fsdp, (list, tuple)) and all(isinstance(w, str) for w in fsdp):
        return list(fsdp)
    raise ConfigError(f"fsdp={fsdp!r} should be true, words such as 'full_shard auto_wrap', or a list of them.")


def _words_config(words: list[str]) -> dict[str, Any]:
    """fsdp's words -> fsdp_config entries."""
    config: dict[str, Any] = {}
    for word in words:
        if word in _FSDP1_WORDS:
            raise ConfigError(f"fsdp={word!r} is an FSDP1 strategy; grpokit shards with FSDP2 only: use "
                              "'full_shard' (or 'shard_grad_op'), with 'offload' to keep the shards in CPU memory.")
        if word not in _WORDS:
            raise ConfigError(f"fsdp: unknown word {word!r}; use {', '.join(map(repr, _WORDS))}.")
        config.update(_WORDS[word])
    return config


def read_fsdp_config(value: Any) -> dict[str, Any]:
    """fsdp_config as a mapping without the "fsdp_" key prefix: a mapping, JSON text, or a JSON file's path."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = Path(value).read_text() if not value.lstrip().startswith("{") and Path(value).is_file() else value
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"fsdp_config={value!r} is neither a mapping, JSON text nor a JSON file "
                              f"({exc}).") from exc
    if not isinstance(value, Mapping):
        raise ConfigError(f"fsdp_config={value!r} must be a mapping such as {{'reshard_after_forward': true}}.")
    return {key[5:] if key.startswith("fsdp_") else key: item for key, item in value.items()}


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    if isinstance(value, str) and key == "reshard_after_forward" and value.upper() in ("FULL_SHARD", "SHARD_GRAD_OP"):
        return value.upper() == "FULL_SHARD"  # FSDP1's strategy names, as accelerate configs written for FSDP1 say
    raise ConfigError(f"fsdp_config {key}={value!r} should be true or false.")


def _config_options(config: dict[str, Any]) -> FSDPOptions:
    """fsdp_config entries (merged from every source) -> FSDPOptions; ConfigError for what FSDP2 here cannot do."""
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ConfigError(f"fsdp_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_KEYS))}.")
    if str(config.get("version", 2)) != "2":
        raise ConfigError(f"fsdp_config version={config['version']!r}: grpokit shards with FSDP2 only; set version 2 "
                          "(fsdp_version: 2 in an accelerate config file).")
    policy = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    if policy != "TRANSFORMER_BASED_WRAP":
        raise ConfigError(f"fsdp_config auto_wrap_policy={policy!r}: grpokit shards each decoder layer "
                          "(TRANSFORMER_BASED_WRAP); name other layer classes with transformer_layer_cls_to_wrap.")
    for key in ("activation_checkpointing_offload", "xla"):
        if key in config and _flag(key, config[key]):
            raise ConfigError(f"fsdp_config {key}=true is not supported; leave it false.")
    flags = {key: _flag(key, config[key]) for key in _BOOL_KEYS if key in config}
    if "cpu_offload" in config:  # TrainingArguments' name for accelerate's offload_params
        flags.setdefault("offload_params", _flag("cpu_offload", config["cpu_offload"]))
    classes = config.get("transformer_layer_cls_to_wrap") or ()
    classes = tuple(c.strip() for c in classes.split(",")) if isinstance(classes, str) else tuple(classes)
    return FSDPOptions(reshard_after_forward=flags.get("reshard_after_forward", True),
                       offload_params=flags.get("offload_params", False),
                       activation_checkpointing=flags.get("activation_checkpointing", False), wrap_classes=classes,
                       cpu_ram_efficient_loading=flags.get("cpu_ram_efficient_loading", False))


def environment_config(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The fsdp_config an `accelerate launch` FSDP config file gave its workers; None when it asked for no FSDP."""
    if environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    config = {key: environ[name] for name, key in _ENVIRONMENT.items() if name in environ}
    config.setdefault("version", "1")  # accelerate's default when the file does not say fsdp_version
    if str(config["version"]) != "2":
        raise ConfigError("The accelerate config file asks for FSDP1 (no fsdp_version: 2); grpokit shards with FSDP2 "
                          "only: add `fsdp_version: 2` under fsdp_config in the file.")
    return config


def refuse_deepspeed(environ: Mapping[str, str]) -> None:
    """ConfigError naming the FSDP2 equivalent when an accelerate DeepSpeed config file launched this process
    (checked before accelerate's Accelerator, which would fail on the missing package with no advice)."""
    if environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ConfigError(f"The accelerate config file asks for DeepSpeed. {DEEPSPEED_ADVICE}.")


def fsdp_options(fsdp: Any, fsdp_config: Any, environ: Mapping[str, str]) -> FSDPOptions | None:
    """The run's sharding, or None for none. `environ`: the process environment (accelerate's variables);
    DeepSpeed asked for there is a ConfigError naming the FSDP2 equivalent."""
    refuse_deepspeed(environ)
    words, from_environment = fsdp_words(fsdp), environment_config(environ)
    if words is None and from_environment is None:
        if fsdp_config:
            raise ConfigError("fsdp_config is read only when fsdp is set (as in TrainingArguments): add "
                              "fsdp='full_shard auto_wrap', or launch with an accelerate FSDP config file.")
        return None
    return _config_options({**(from_environment or {}), **_words_config(words or []), **read_fsdp_config(fsdp_config)})


def fsdp_option_problem(name: str, value: Any) -> str | None:
    """The problem of `fsdp` or `fsdp_config` given alone (config checks), None when the value can work (any
    ds3_gather_for_generation: its type is checked with the other fields)."""
    try:
        if name == "fsdp":
            _words_config(fsdp_words(value) or [])
        elif name == "fsdp_config":
            _config_options(read_fsdp_config(value))
    except (ConfigError, OSError) as exc:
        return str(exc)
    return None

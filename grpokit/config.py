"""GRPOConfig: every training option, each documented once by the docstring under its field.

Those docstrings are the single source of documentation: `field_docs()` reads them from this file's source and
`grpo train --help` prints them. Option names follow TRL's GRPOConfig where the meaning is the same.
Validation runs in `__post_init__`, before any model is loaded, and every message says how to fix the value.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml

from grpokit.algorithms import (
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTION_MODES,
    LOSS_AGGREGATIONS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    REWARD_SCALES,
)


class ConfigError(ValueError):
    """An option has a value that cannot work; the message says which and how to fix it."""


@dataclass
class GRPOConfig:
    # --- output and bookkeeping ---
    output_dir: str = "outputs/grpo"
    """Folder for metrics.jsonl, completions.jsonl, checkpoints and the final model."""
    overwrite_output_dir: bool = False
    """Allow training into an output_dir that already holds checkpoints (they are left in place)."""
    seed: int = 42
    """Seed for python, numpy, torch and the sampling generator; the same seed gives the same run on CPU."""
    logging_steps: int = 1
    """Write a metrics.jsonl row every this many optimizer steps."""
    log_completions: bool = True
    """Write sampled completions with their rewards and advantages to completions.jsonl."""
    completions_logging_steps: int = 10
    """Write completions.jsonl rows every this many optimizer steps (when log_completions)."""
    report_to: list[str] = field(default_factory=list)
    """Extra metric sinks: any of "tensorboard", "wandb", "trackio" (each must be installed)."""
    disable_tqdm: bool = False
    """Print one log line per logged step instead of a progress bar (also automatic when stderr is not a TTY)."""

    # --- schedule and optimiser ---
    max_steps: int = -1
    """Number of optimizer steps; -1 derives it from num_train_epochs and the dataset size."""
    num_train_epochs: float = 1.0
    """Passes over the prompts when max_steps = -1 (each pass samples num_generations completions per prompt)."""
    learning_rate: float = 1e-6
    """Peak AdamW learning rate."""
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    """Decay after warm-up: linear to 0, cosine to 0, or constant."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to learning_rate (wins over warmup_ratio when > 0)."""
    warmup_ratio: float = 0.0
    """Fraction of max_steps used for warm-up when warmup_steps = 0."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    max_consecutive_nonfinite_steps: int = 3
    """An optimizer step whose loss or gradient norm is NaN/inf is skipped: gradients are dropped and neither the
    optimizer nor the learning-rate schedule steps (logged as nonfinite_skipped, and nonfinite_skips in total);
    after this many skipped steps in a row training stops with an error."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""
    bf16: bool = False
    """Run the rollout, the log-prob passes and the update's forward and backward under bfloat16 autocast (CPU or
    GPU). Weights, gradients and optimizer state stay fp32, and so do the log-softmax normaliser, the loss and
    the sampler's probabilities. Faster only where the hardware has bf16 matmuls (GPUs; CPUs with AMX or
    AVX512-BF16); on other CPUs it is slower than fp32 (benchmarks/README.md)."""

    # --- batch geometry (counts are completions, as in TRL) ---
    per_device_train_batch_size: int = 8
    """Completions per micro-batch on each process."""
    gradient_accumulation_steps: int = 1
    """Micro-batches whose gradients are summed into one optimizer step."""
    num_generations: int = 8
    """G: completions sampled per prompt; advantages are computed within each group of G."""
    steps_per_generation: int | None = None
    """Micro-batches drawn from one generation batch (default gradient_accumulation_steps); a multiple of it."""
    generation_batch_size: int | None = None
    """Completions per generation on all processes together; default per_device_train_batch_size x processes x
    steps_per_generation. Set this or steps_per_generation, not both."""
    num_iterations: int = 1
    """mu: optimisation passes over each generation batch; > 1 computes old log-probs once per generation."""
    shuffle_dataset: bool = True
    """Shuffle the prompt order each epoch (seeded)."""

    # --- generation ---
    max_prompt_length: int | None = 512
    """Prompts longer than this many tokens are an error (None: only the model's context limit applies)."""
    max_completion_length: int = 256
    """Maximum tokens generated per completion."""
    temperature: float = 1.0
    """Sampling temperature; also divides the logits when log-probs are computed for the loss."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    min_p: float | None = None
    """Drop tokens whose probability is below min_p x the top token's; None disables."""
    repetition_penalty: float = 1.0
    """Penalise tokens already in the prompt or completion (> 1 discourages repetition)."""
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments passed to `model.generate`, e.g. {"min_new_tokens": 64}; they win over the above."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."""

    # --- rollout engine (docs/vllm.md) ---
    rollout_engine: str = "local"
    """What generates the completions: "local" (grpokit's decode loop in this process: tokens depend only on
    (seed, sample id, position), exact resume), "vllm" (same as use_vllm=True), another name registered with
    grpokit.rollout.register_rollout_engine, or an import path "pkg.module:factory"."""
    use_vllm: bool = False
    """Generate with vLLM (install: pip install -e ".[vllm]"); vllm_mode picks colocate or server."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """"colocate": a vllm.LLM inside each training process, weights pushed in memory; "server": a separate vLLM
    server (start one with `grpo vllm-serve --model PATH`), weights pushed through vllm_server_weights_dir."""
    vllm_server_base_url: str | None = None
    """Server mode: the server's base URL, e.g. "http://10.0.0.5:8000"; wins over vllm_server_host and _port."""
    vllm_server_host: str = "0.0.0.0"
    """Server mode: host of the vLLM server (when vllm_server_base_url is not set)."""
    vllm_server_port: int = 8000
    """Server mode: port of the vLLM server (when vllm_server_base_url is not set)."""
    vllm_server_timeout: float = 240.0
    """Server mode: seconds to wait for the server to answer /health at start, and for any one request."""
    vllm_server_weights_dir: str | None = None
    """Server mode: folder, readable by the server, where each weight push writes model.safetensors before the
    server reloads it; None: output_dir/.vllm-weights (right for a server on this machine or a shared disk)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Colocate mode on a GPU: fraction of GPU memory vLLM may take (weights + KV cache). On a CPU the KV cache is
    sized to the generation batch instead, and this option is not used."""
    vllm_tensor_parallel_size: int = 1
    """Colocate mode: GPUs one vLLM engine spreads the model over."""
    vllm_enable_sleep_mode: bool = False
    """Colocate mode on a GPU: offload vLLM's weights and free its KV cache while the trainer updates (needs CUDA)."""
    vllm_importance_sampling_correction: bool = True
    """With any engine but "local": weight each token's policy-gradient term by the ratio p_trainer / p_sampler of
    the sampled token (trainer log-probs recomputed at generation), corrected per vllm_importance_sampling_mode;
    the sampling/* metrics then report the mismatch (docs/vllm.md says which values are healthy)."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """token_truncate | token_mask | sequence_truncate | sequence_mask: a ratio per token or one per sequence, and
    ratios outside [clip_min, clip_max] clipped to the bounds (truncate) or set to 0 (mask). Formulas:
    grpokit/algorithms/mismatch.py."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """Upper bound C_max on the mismatch ratio (None: no upper bound)."""
    vllm_importance_sampling_clip_min: float | None = None
    """Lower bound C_min on the mismatch ratio (None: no lower bound)."""

    # --- loss ---
    beta: float = 0.0
    """Weight of the k3 KL penalty to the reference model; 0 loads no reference model."""
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clip range: clipped above at 1 + epsilon_high (DAPO clip-higher); None = epsilon."""
    delta: float | None = None
    """Optional cap on the unclipped ratio (two-sided clipping); must exceed 1 + epsilon_high."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token (GRPO) or one per sequence from the mean log-ratio (GSPO)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """How token losses are averaged; formulas in docs/algorithms.md."""

    # --- rewards and advantages ---
    reward_weights: list[float] | None = None
    """One weight per reward function, in order; None weights each 1.0."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Weighted sum of rewards then group normalisation, or normalise each reward in its group then weight and sum."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Divide centred rewards by the group std, the batch std, or nothing (Dr. GRPO)."""
    reward_error_policy: Literal["raise", "none"] = "raise"
    """A reward function that raises or returns a non-number: stop training, or score that sample None and count it."""
    reward_model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for reward models given as a path or hub name (e.g. {"batch_size": 16}); the device
    defaults to this process's device."""

    # --- checkpoints ---
    save_strategy: Literal["no", "steps"] = "no"
    """Save checkpoint-<step>/ every save_steps optimizer steps ("steps") or never ("no")."""
    save_steps: int = 500
    """Optimizer steps between checkpoints when save_strategy = "steps"."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints; None keeps all."""

    # --- model loading ---
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the model is a name or a path."""

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def resolved_steps_per_generation(self, num_processes: int = 1) -> int:
        """Micro-batches per generation batch, from steps_per_generation or generation_batch_size."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size // (self.per_device_train_batch_size * num_processes)
        return self.steps_per_generation or self.gradient_accumulation_steps

    def global_generation_batch_size(self, num_processes: int = 1) -> int:
        """Completions per generation on all processes together."""
        return self.per_device_train_batch_size * num_processes * self.resolved_steps_per_generation(num_processes)

    def check_geometry(self, num_processes: int) -> None:
        """Batch checks that depend on the number of processes (run again by the trainer)."""
        per_step = self.per_device_train_batch_size * num_processes
        if self.generation_batch_size is not None and self.generation_batch_size % per_step:
            raise ConfigError(
                f"generation_batch_size={self.generation_batch_size} must be a multiple of "
                f"per_device_train_batch_size x processes = {per_step}; try {per_step * max(1, round(self.generation_batch_size / per_step))}."
            )
        spg = self.resolved_steps_per_generation(num_processes)
        if spg % self.gradient_accumulation_steps:
            raise ConfigError(
                f"steps_per_generation={spg} must be a multiple of gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps} (one generation feeds whole optimizer steps)."
            )
        total = self.global_generation_batch_size(num_processes)
        if total % self.num_generations:
            raise ConfigError(
                f"The generation batch holds {total} completions (per_device_train_batch_size="
                f"{self.per_device_train_batch_size} x {num_processes} processes x steps_per_generation={spg}), "
                f"which is not divisible by num_generations={self.num_generations}. Make the generation batch a "
                f"multiple of num_generations, e.g. per_device_train_batch_size={self.num_generations}."
            )

    # --- loading ---
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "GRPOConfig":
        """Build from a plain dict; unknown keys are errors naming the nearest valid key."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(f"Unknown option {key!r}.{_did_you_mean(key, known)}")
        return cls(**{key: coerce_option(key, value) for key, value in values.items()})

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GRPOConfig":
        return cls.from_dict(load_yaml(path))


def _did_you_mean(key: str, known: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.5)
    return f" Did you mean {close[0]!r}?" if close else " See `grpo train --help` for the valid options."


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist.")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of option: value, not a {type(data).__name__}.")
    return data


def _choices(name: str, value: Any, table: typing.Iterable[str]) -> None:
    if value not in table:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of: {', '.join(sorted(table))}.")


def _validate(c: GRPOConfig) -> None:
    _choices("loss_type", c.loss_type, LOSS_AGGREGATIONS)
    _choices("scale_rewards", c.scale_rewards, REWARD_SCALES)
    _choices("multi_objective_aggregation", c.multi_objective_aggregation, MULTI_OBJECTIVE_AGGREGATIONS)
    _choices("importance_sampling_level", c.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
    _choices("vllm_importance_sampling_mode", c.vllm_importance_sampling_mode, IS_CORRECTION_MODES)
    _check_rollout_options(c)
    _choices("lr_scheduler_type", c.lr_scheduler_type, ("linear", "cosine", "constant"))
    _choices("save_strategy", c.save_strategy, ("no", "steps"))
    _choices("reward_error_policy", c.reward_error_policy, ("raise", "none"))
    for sink in c.report_to:
        _choices("report_to", sink, ("tensorboard", "wandb", "trackio"))

    def positive(name: str, minimum: int = 1) -> None:
        value = getattr(c, name)
        if value < minimum:
            raise ConfigError(f"{name}={value} must be at least {minimum}.")

    if c.num_generations < 2:
        raise ConfigError(
            f"num_generations={c.num_generations}: GRPO compares completions within a group, so it needs at "
            "least 2 per prompt (8 or 16 is typical)."
        )
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "max_completion_length", "logging_steps", "completions_logging_steps", "save_steps",
                 "max_consecutive_nonfinite_steps"):
        positive(name)
    if c.steps_per_generation is not None and c.generation_batch_size is not None:
        raise ConfigError("Set steps_per_generation or generation_batch_size, not both (one implies the other).")
    if c.steps_per_generation is not None:
        positive("steps_per_generation")
    if c.max_prompt_length is not None:
        positive("max_prompt_length")
    if c.save_total_limit is not None:
        positive("save_total_limit")
    if c.max_steps == 0 or c.max_steps < -1:
        raise ConfigError(f"max_steps={c.max_steps}: use a positive number of steps, or -1 to use num_train_epochs.")
    if c.max_steps == -1 and not c.num_train_epochs > 0:
        raise ConfigError(f"num_train_epochs={c.num_train_epochs} must be > 0 when max_steps = -1.")
    if not c.learning_rate >= 0:
        raise ConfigError(f"learning_rate={c.learning_rate} must be >= 0 (typical GRPO values: 1e-6 to 1e-5).")
    if not 0 <= c.warmup_ratio < 1:
        raise ConfigError(f"warmup_ratio={c.warmup_ratio} must be in [0, 1).")
    if c.warmup_steps < 0 or c.max_grad_norm < 0 or c.weight_decay < 0:
        raise ConfigError("warmup_steps, max_grad_norm and weight_decay must be >= 0.")
    if not 0 <= c.epsilon < 1:
        raise ConfigError(f"epsilon={c.epsilon} must be in [0, 1): the ratio is clipped below at 1 - epsilon.")
    if c.epsilon_high is not None and c.epsilon_high < 0:
        raise ConfigError(f"epsilon_high={c.epsilon_high} must be >= 0 (DAPO uses 0.28).")
    if c.delta is not None and c.delta <= 1 + c.resolved_epsilon_high:
        raise ConfigError(
            f"delta={c.delta} must exceed 1 + epsilon_high = {1 + c.resolved_epsilon_high}, or the cap would "
            "clip inside the trust region; INTELLECT-2 uses 4."
        )
    if c.beta < 0:
        raise ConfigError(f"beta={c.beta} must be >= 0 (0 disables the KL penalty; DeepSeekMath used 0.04).")
    if not c.temperature > 0:
        raise ConfigError(
            f"temperature={c.temperature} must be > 0: GRPO samples a group of different completions; for "
            "near-greedy sampling use a small value such as 0.1."
        )
    if not 0 < c.top_p <= 1:
        raise ConfigError(f"top_p={c.top_p} must be in (0, 1].")
    if c.top_k < 0:
        raise ConfigError(f"top_k={c.top_k} must be >= 0 (0 disables).")
    if c.min_p is not None and not 0 <= c.min_p < 1:
        raise ConfigError(f"min_p={c.min_p} must be in [0, 1).")
    if not c.repetition_penalty > 0:
        raise ConfigError(f"repetition_penalty={c.repetition_penalty} must be > 0 (1.0 disables).")
    if c.reward_weights is not None and any(not isinstance(w, (int, float)) for w in c.reward_weights):
        raise ConfigError(f"reward_weights={c.reward_weights} must be a list of numbers.")
    c.check_geometry(num_processes=1)


def _check_rollout_options(c: GRPOConfig) -> None:
    from grpokit.rollout.engine import engine_names
    from grpokit.rollout.vllm_engine import VLLM_MODES

    _choices("vllm_mode", c.vllm_mode, VLLM_MODES)
    if ":" not in c.rollout_engine:
        _choices("rollout_engine", c.rollout_engine, engine_names())
    if c.use_vllm and c.rollout_engine not in ("local", "vllm"):
        raise ConfigError(
            f"use_vllm=True and rollout_engine={c.rollout_engine!r} name two different engines; set only one."
        )
    if not 0 < c.vllm_server_port < 65536:
        raise ConfigError(f"vllm_server_port={c.vllm_server_port} must be a TCP port (1-65535).")
    if not (c.vllm_server_timeout > 0 and math.isfinite(c.vllm_server_timeout)):
        raise ConfigError(f"vllm_server_timeout={c.vllm_server_timeout} must be a positive number of seconds.")
    if not 0 < c.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"vllm_gpu_memory_utilization={c.vllm_gpu_memory_utilization} must be in (0, 1].")
    if c.vllm_tensor_parallel_size < 1:
        raise ConfigError(f"vllm_tensor_parallel_size={c.vllm_tensor_parallel_size} must be at least 1.")
    if c.vllm_server_base_url is not None and not c.vllm_server_base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"vllm_server_base_url={c.vllm_server_base_url!r} must start with http:// or https://, "
            "e.g. 'http://127.0.0.1:8000'."
        )
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    for name, bound in (("clip_min", low), ("clip_max", high)):
        if bound is not None and not (bound > 0 and math.isfinite(bound)):
            raise ConfigError(f"vllm_importance_sampling_{name}={bound} must be a positive finite ratio or null.")
    if low is not None and high is not None and low >= high:
        raise ConfigError(
            f"vllm_importance_sampling_clip_min={low} must be less than vllm_importance_sampling_clip_max={high}."
        )
    if c.vllm_importance_sampling_correction and low is None and high is None:
        raise ConfigError(
            "vllm_importance_sampling_correction=True needs at least one of vllm_importance_sampling_clip_min / "
            "_clip_max (TRL's default: clip_max=3.0); or set the correction to False."
        )


# --- field documentation and type coercion (for YAML and the command line) ---


@lru_cache(maxsize=None)
def field_docs(cls: type = GRPOConfig) -> dict[str, str]:
    """The docstring under each dataclass field, read from the source: {field name: text}."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


_UNION_TYPES = (typing.Union, types.UnionType)


def _field_type(name: str) -> Any:
    return typing.get_type_hints(GRPOConfig)[name]


def coerce_option(name: str, value: Any) -> Any:
    """Check `value` against the field's annotation; command-line strings are parsed as YAML scalars first."""
    hint = _field_type(name)
    if isinstance(value, str) and not _matches(value, hint):  # "no" stays "no" where a string is valid
        parsed = yaml.safe_load(value) if value != "" else None
        value = parsed if parsed is not None or _allows_none(hint) else value
    if not _matches(value, hint):
        raise ConfigError(f"{name}={value!r} should be {_describe(hint)}.")
    origin = typing.get_origin(hint)
    if hint is float or (origin in _UNION_TYPES and float in typing.get_args(hint)):
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
    return value


def _allows_none(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(hint)
    if origin in _UNION_TYPES:
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin in _UNION_TYPES:
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if hint is type(None):
        return "null"
    return getattr(hint, "__name__", str(hint)).replace("NoneType", "null")

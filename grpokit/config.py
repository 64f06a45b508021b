"""GRPOConfig: every training option, each documented once by the docstring under its field.

Those docstrings are the single source of documentation: `field_docs()` reads them from this file's source and
`grpo train --help` prints them. Option names follow TRL's GRPOConfig where the meaning is the same.
Validation runs in `__post_init__`, before any model is loaded, and every message says how to fix the value.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import inspect
import math
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

import yaml

from grpokit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    IS_CORRECTION_MODES,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    MULTI_OBJECTIVE_AGGREGATIONS,
    POLICY_OBJECTIVES,
    REWARD_SCALES,
    resolve_loss_type,
)
from grpokit.errors import ConfigError
from grpokit.trl_compat import is_trl_option, script_key_advice, trl_option_problem

# transformers' schedulers (get_scheduler) but reduce_lr_on_plateau, which needs an eval loss GRPO does not have
LR_SCHEDULER_TYPES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
    "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay",
)
SAVE_STRATEGIES = ("no", "steps", "epoch")
EVAL_STRATEGIES = ("no", "steps", "epoch")
REWARD_ERROR_POLICIES = ("raise", "none")
# tracker name -> (packages that provide it, the one to install): the one list of report_to's names. torch's
# SummaryWriter needs tensorboard; accelerate falls back to tensorboardX when torch.utils.tensorboard cannot import.
TRACKER_PACKAGES = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
REPORT_SINKS = tuple(TRACKER_PACKAGES)


def tracker_installed(name: str) -> bool:
    """Whether a package that provides tracker `name` can be imported."""
    return any(importlib.util.find_spec(module) is not None for module in TRACKER_PACKAGES[name][0])


@dataclass
class GRPOConfig:
    # --- output and bookkeeping ---
    output_dir: str = "outputs/grpo"
    """Folder for metrics.jsonl, completions.jsonl, checkpoints and the final model."""
    overwrite_output_dir: bool = False
    """Allow training into an output_dir that already holds checkpoints (they are left in place)."""
    resume_fallback: bool = False
    """With resume_from_checkpoint=True (--resume): when the newest checkpoint fails verification (a file missing,
    resized or changed since it was saved), resume from the newest older one that verifies, with a warning,
    instead of stopping with an error that names the damaged file."""
    seed: int = 42
    """Seed for python, numpy, torch and the sampling generator; the same seed gives the same run on CPU."""
    logging_steps: int = 1
    """Write a metrics.jsonl row every this many optimizer steps: the mean of each metric over those steps (as
    TRL), with the last step's learning rate and counters."""
    logging_first_step: bool = False
    """Also log the first optimizer step when logging_steps > 1."""
    run_name: str | None = None
    """Name of the run for the trackers (wandb, trackio, tensorboard); default: the output_dir's folder name."""
    log_completions: bool = True
    """Write sampled completions with their rewards and advantages to completions.jsonl."""
    completions_logging_steps: int = 10
    """Write completions.jsonl rows every this many optimizer steps (when log_completions)."""
    report_to: list[str] | str = field(default_factory=list)
    """Trackers that also get every metrics row (metrics.jsonl is always written): a list, one name, "all" (every
    installed one) or "none"; each must be installed."""
    num_completions_to_print: int | None = None
    """At each logged step, print this many sampled completions (prompt, completion, rewards) to stderr."""
    disable_tqdm: bool = False
    """Print one log line per logged step instead of a progress bar (also automatic when stderr is not a TTY)."""

    # --- schedule and optimiser ---
    max_steps: int = -1
    """Number of optimizer steps; -1 derives it from num_train_epochs and the dataset size."""
    num_train_epochs: float = 1.0
    """Passes over the prompts when max_steps = -1 (each pass samples num_generations completions per prompt)."""
    learning_rate: float = 1e-6
    """Peak AdamW learning rate."""
    lr_scheduler_type: str = "linear"
    """The learning-rate schedule after warm-up: any of transformers' get_scheduler types (linear to 0, cosine
    to 0, constant, cosine_with_min_lr, ...)."""
    lr_scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of the schedule, e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr, {"num_cycles": 2} for
    cosine_with_restarts (as transformers' lr_scheduler_kwargs)."""
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
    gradient_checkpointing_kwargs: dict[str, Any] | None = None
    """Arguments of model.gradient_checkpointing_enable (default {"use_reentrant": False})."""
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
    """Extra keyword arguments passed to `model.generate` (or vLLM's SamplingParams), e.g. {"min_new_tokens": 64};
    they win over the above. do_sample=True is accepted and changes nothing (sampling is always on)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."""

    # --- rollout engine (docs/vllm.md) ---
    rollout_engine: str = "local"
    """What generates the completions: "local" (grpokit's decode loop in this process: tokens depend only on
    (seed, sample id, position), exact resume), "vllm" (same as use_vllm=True), another name registered with
    grpokit.rollout.register_rollout_engine, or an import path "pkg.module:factory"."""
    use_vllm: bool = False
    """Generate with vLLM (install: pip install -e ".[vllm]"); vllm_mode picks colocate or server."""
    vllm_mode: str = "colocate"
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

    # --- loss (formulas: grpokit/algorithms/losses.py and docs/algorithms.md) ---
    loss_type: str = "dapo"
    """TRL's name: a loss aggregation (how per-token losses become one number), or a policy objective, which then
    comes with its paper's aggregation (cispo: dapo, sapo: grpo, luspo: sequence_sum, vespo: dapo, gmpo: grpo)."""
    policy_objective: str | None = None
    """The per-token objective when loss_type names an aggregation (None: "clip", PPO-clip as in GRPO); lets any
    objective be combined with any aggregation."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Settings for a policy objective or aggregation registered from your own code (LossSettings.extra)."""
    importance_sampling_level: str = "token"
    """Importance ratio per token (GRPO), one per sequence from the mean log-ratio (GSPO), or GSPO's sequence value
    with a per-token gradient (sequence_token, GSPO-token)."""
    epsilon: float = 0.2
    """Lower clip range: the ratio is clipped below at 1 - epsilon (gmpo: the log-ratio at -epsilon)."""
    epsilon_high: float | None = None
    """Upper clip range: clipped above at 1 + epsilon_high (DAPO clip-higher: 0.28); None = epsilon. For cispo it is
    the largest importance weight itself (ScaleRL: 5.0); for gmpo the log-ratio bound."""
    delta: float | None = None
    """Optional cap on the unclipped ratio (two-sided clipping, INTELLECT-2); must exceed 1 + epsilon_high."""
    sapo_temperature_pos: float = 1.0
    """sapo: temperature of the soft gate for tokens with a positive advantage."""
    sapo_temperature_neg: float = 1.05
    """sapo: temperature of the soft gate for tokens with a non-positive advantage."""
    vespo_k_pos: float = 2.0
    """vespo: power k of the gamma weight for A >= 0 (how fast weights below 1 are damped)."""
    vespo_lambda_pos: float = 3.0
    """vespo: decay lambda of the gamma weight for A >= 0 (how fast weights above 1 are damped)."""
    vespo_k_neg: float = 3.0
    """vespo: power k of the gamma weight for A < 0."""
    vespo_lambda_neg: float = 2.0
    """vespo: decay lambda of the gamma weight for A < 0."""
    off_policy_mask_threshold: float | None = None
    """DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose mean log-ratio
    log pi_sampler - log pi_theta exceeds this (e.g. 0.5) leaves the policy term; None disables."""
    beta: float = 0.0
    """KL coefficient (DeepSeekMath: 0.04; DeepSeek-R1: 0.001); 0 loads no reference model."""
    kl_estimator: str = "k3"
    """How KL(pi_theta || pi_ref) is estimated per token: k1, k2, k3, or k3+ (k3's value, k2's gradient)."""
    kl_in_reward: bool = False
    """Put the KL in the reward instead of the loss: each completion's reward gets -beta x its summed per-token
    KL (measured at generation) before advantages are computed, as one more reward term."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL in the loss by the importance weight (with its gradient), so its gradient is the
    unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default)."""
    top_entropy_quantile: float = 1.0
    """Train the policy term only on the tokens whose entropy is in the top this fraction of the micro-batch's
    counted tokens on all processes ("Beyond the 80/20 rule" recommends 0.2); 1.0 keeps all tokens."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss gets -entropy_coef x the mean per-token entropy (over the tokens the policy term
    trains on); with use_adaptive_entropy, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control: after each optimizer step the coefficient moves by
    entropy_coef_delta, up when the step's entropy was at or below entropy_target and down otherwise (within
    [entropy_coef_min, entropy_coef_max]); the bonus applies only while the entropy is at or below the target."""
    entropy_coef_min: float = 0.0
    """Adaptive entropy control: lowest coefficient."""
    entropy_coef_max: float = 1.0
    """Adaptive entropy control: highest coefficient."""
    entropy_coef_delta: float = 0.005
    """Adaptive entropy control: change of the coefficient per optimizer step."""
    entropy_target: float = 0.2
    """Adaptive entropy control: target mean per-token entropy (nats), over the tokens the policy term trains on."""
    sync_ref_model: bool = False
    """TR-DPO's reference sync: every ref_model_sync_steps optimizer steps, pi_ref <- alpha pi_theta +
    (1 - alpha) pi_ref (needs beta > 0)."""
    ref_model_mixup_alpha: float = 0.6
    """alpha of the reference sync (1.0 copies the policy)."""
    ref_model_sync_steps: int = 512
    """Optimizer steps between reference syncs."""

    # --- tools and environments: multi-turn rollouts (docs/tools.md) ---
    tools: list[Any] = field(default_factory=list)
    """Tools the model may call, by name ("calculator", "python": grpokit.tools.TOOLS), import path
    "pkg.module:function" or (from Python) the function itself: type hints and a docstring with an Args: section.
    Added to GRPOTrainer(tools=...); on the command line a comma-separated list. Any tool or environment turns
    each rollout into an episode of several turns."""
    environment_factory: str | None = None
    """Import path "pkg.module:factory" of an environment factory (grpokit/rollout/environments.py has the
    contract); the YAML form of GRPOTrainer(environment_factory=...), which it may not be given together with."""
    max_tool_calling_iterations: int | None = None
    """Rounds of tool results (or environment answers) per episode; None: only max_completion_length, which
    bounds the whole transcript (tool tokens included), limits them. A call past the limit ends the episode."""
    tool_call_format: Any = "qwen"
    """How the model writes tool calls: "qwen" (= "hermes": <tool_call>{"name": ..., "arguments": {...}}</tool_call>),
    "compact" (<call>name(argument)</call>), another name in grpokit.tools.TOOL_CALL_FORMATS, an import path, or
    (from Python) a format object with parse(text) and render_results(results)."""
    tool_timeout: float = 10.0
    """Seconds one tool call may take; a slower call becomes an error message the model reads."""

    # --- rewards and advantages ---
    reward_weights: list[float] | None = None
    """One weight per reward function, in order; None weights each 1.0."""
    advantage_estimator: str = "grpo"
    """Baseline and scale of the advantages: grpo (group mean, scale_rewards), rloo (leave-one-out mean,
    scale_rewards), reinforce_plus_plus_baseline (group mean, batch std of the centred rewards)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Weighted sum of rewards then the estimator, or the estimator on each reward then the weighted sum."""
    scale_rewards: str = "group"
    """Divide centred rewards by the group std, the batch std, or nothing (Dr. GRPO)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are dropped and more
    prompts are sampled until the generation batch is full of informative groups."""
    dynamic_sampling_max_rounds: int = 8
    """Dynamic sampling: most generation rounds for one batch; after them the batch is topped up with dropped
    groups (with a warning and the dynamic_sampling/filled_with_flat metric)."""
    reward_error_policy: str = "raise"
    """A reward function that raises or returns a non-number: stop training, or score that sample None and count it."""
    reward_model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for reward models given as a path or hub name (e.g. {"batch_size": 16}); the device
    defaults to this process's device."""

    # --- checkpoints ---
    save_strategy: str = "no"
    """Save checkpoint-<step>/ every save_steps optimizer steps ("steps") or never ("no")."""
    save_steps: int = 500
    """Optimizer steps between checkpoints when save_strategy = "steps"."""
    save_total_limit: int | None = None
    """Keep only the newest N checkpoints; None keeps all."""
    push_to_hub: bool = False
    """After training, publish the final model (the files of OUTPUT_DIR, not its checkpoints) to hub_model_id: a
    local folder (a path starting with /, ./, ../, ~ or file://) gets a copy; anything else is a Hugging Face Hub
    repository, created if missing (log in with `hf auth login` or set HF_TOKEN). A failed push is logged as an
    error and leaves the trained model in OUTPUT_DIR."""
    hub_model_id: str | None = None
    """Where push_to_hub publishes; None: the name of output_dir's folder (a hub repository under your account)."""
    hub_private_repo: bool | None = None
    """Create the hub repository private (None: the hub's default)."""

    # --- evaluation ---
    eval_strategy: str = "no"
    """When to evaluate on eval_dataset during training: "no" (only after training), every eval_steps optimizer
    steps ("steps"), or after each pass over the prompts ("epoch"). Evaluation samples num_generations_eval
    completions per eval prompt and logs eval/reward, each function's mean and each compute_metrics value."""
    eval_steps: int | None = None
    """Optimizer steps between evaluations when eval_strategy = "steps" (default: logging_steps)."""
    eval_on_start: bool = False
    """Also evaluate before the first optimizer step (a baseline for the eval curves)."""
    per_device_eval_batch_size: int | None = None
    """Completions generated at once during evaluation (default: the training generation batch)."""
    num_generations_eval: int | None = None
    """Completions sampled per eval prompt (default: num_generations)."""
    metric_for_best_model: str | None = None
    """An eval metric ("eval/reward", "eval/rewards/<name>/mean", "eval/metrics/<name>/mean", the same without
    "eval/", or TRL's form "eval_reward"): after each evaluation that improves it, the model is saved to OUTPUT_DIR/best (state.best_metric,
    state.best_model_checkpoint). None: eval/reward when load_best_model_at_end, else no best model is kept."""
    greater_is_better: bool | None = None
    """Whether a larger metric_for_best_model is better (default True)."""
    load_best_model_at_end: bool = False
    """Save the best evaluated model (metric_for_best_model) as the final model in output_dir instead of the
    last one; needs an eval_dataset and eval_strategy other than "no"."""

    # --- model loading ---
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for `AutoModelForCausalLM.from_pretrained` when the model is a name or a path."""
    trust_remote_code: bool = False
    """Allow model and tokenizer code from the model's repository (from_pretrained's trust_remote_code)."""
    disable_dropout: bool = False
    """Set every dropout probability of the policy (and reference) to 0, so log-probs do not depend on dropout."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments of the tokenizer's apply_chat_template for conversational prompts, e.g.
    {"enable_thinking": False}."""
    use_cpu: bool = False
    """Train on the CPU even where a GPU is visible."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, trl_value_form(f.name, getattr(self, f.name)))
        try:
            _validate(self)
        except TypeError as exc:  # a value of the wrong type (from Python) reached a check: name every such option
            problems = _type_problems(self)
            if not problems:
                raise
            raise ConfigError(problems_message(problems)) from exc

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def resolved_loss(self) -> tuple[str, str]:
        """(policy objective, loss aggregation) named by loss_type and policy_objective."""
        return resolve_loss_type(self.loss_type, self.policy_objective)

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
        """Build from a plain dict (YAML, command line): every unknown key and badly typed value is reported at
        once; TRL options grpokit does not define are accepted where they ask for nothing (trl_compat.py)."""
        known = {f.name for f in dataclasses.fields(cls)}
        coerced, problems = {}, []
        for key, value in values.items():
            if key not in known:
                continue
            try:
                coerced[key] = coerce_option(key, value)
            except ConfigError as exc:
                problems.append(str(exc))
        problems += option_problems(values)
        if problems:
            raise ConfigError(problems_message(problems))
        return cls(**coerced)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "GRPOConfig":
        return cls.from_dict(load_yaml(path))


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(GRPOConfig))
_dataclass_init = GRPOConfig.__init__


def option_problems(values: dict[str, Any]) -> list[str]:
    """A message for each key of `values` that is neither a GRPOConfig field nor a TRL option accepted here."""
    problems = []
    for key, value in values.items():
        if key in _FIELD_NAMES:
            continue
        if is_trl_option(key):
            problem = trl_option_problem(key, value)
        else:
            problem = f"Unknown option {key!r}.{script_key_advice(key) or _did_you_mean(key, _FIELD_NAMES)}"
        if problem:
            problems.append(problem)
    return problems


def _type_problems(c: GRPOConfig) -> list[str]:
    """A message for each field whose value does not have the field's type (e.g. num_generations="3")."""
    return [
        f"{f.name}={getattr(c, f.name)!r} should be {_describe(_field_type(f.name))}."
        for f in dataclasses.fields(c) if not _matches(getattr(c, f.name), _field_type(f.name))
    ]


def problems_message(problems: list[str]) -> str:
    if len(problems) == 1:
        return problems[0]
    return f"{len(problems)} problems in the options:\n" + "\n".join(f"  - {p}" for p in problems)


def _init(self, *args: Any, **kwargs: Any) -> None:
    problems = option_problems(kwargs)
    if problems:
        raise ConfigError(problems_message(problems))
    _dataclass_init(self, *args, **{k: v for k, v in kwargs.items() if k in _FIELD_NAMES})


_init.__signature__ = inspect.signature(_dataclass_init)  # help() and IDEs show the fields
_init.__doc__ = "GRPOConfig(**options): TRL's options are accepted where they ask for nothing (trl_compat.py)."
GRPOConfig.__init__ = _init


def _vllm_modes():
    from grpokit.rollout.vllm_engine import VLLM_MODES

    return VLLM_MODES


class _Lazy:
    """A choice table imported on first use (the vLLM engine module is not imported with the config)."""

    def __init__(self, load: Callable[[], Any]) -> None:
        self._load = load

    def __iter__(self):
        return iter(self._load())

    def __contains__(self, item: object) -> bool:
        return item in self._load()


# Every option with a fixed set of values -> the one table that lists them (a Registry or a tuple).
# loss_type and policy_objective are checked together by resolve_loss_type.
OPTION_CHOICES: dict[str, Any] = {
    "importance_sampling_level": IMPORTANCE_SAMPLING_LEVELS,
    "kl_estimator": KL_ESTIMATORS,
    "advantage_estimator": ADVANTAGE_ESTIMATORS,
    "multi_objective_aggregation": MULTI_OBJECTIVE_AGGREGATIONS,
    "scale_rewards": REWARD_SCALES,
    "vllm_importance_sampling_mode": IS_CORRECTION_MODES,
    "vllm_mode": _Lazy(_vllm_modes),
    "lr_scheduler_type": LR_SCHEDULER_TYPES,
    "save_strategy": SAVE_STRATEGIES,
    "eval_strategy": EVAL_STRATEGIES,
    "reward_error_policy": REWARD_ERROR_POLICIES,
    "report_to": REPORT_SINKS,
}


def option_choices(name: str) -> list[str] | None:
    """The valid values of option `name` (None for free-form options), for help text and docs."""
    if name == "loss_type":
        return sorted(set(LOSS_AGGREGATIONS.names()) | set(POLICY_OBJECTIVES.names()))
    if name == "policy_objective":
        return POLICY_OBJECTIVES.names()
    table = OPTION_CHOICES.get(name)
    return None if table is None else sorted(table)


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


def _registry_choice(name: str, value: str, registry) -> None:
    try:
        registry.resolve(value)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _validate(c: GRPOConfig) -> None:
    for name, table in OPTION_CHOICES.items():
        value = getattr(c, name)
        if hasattr(table, "resolve"):
            _registry_choice(name, value, table)
        elif name != "report_to":
            _choices(name, value, table)
    if not isinstance(c.report_to, list):
        raise ConfigError(f"report_to={c.report_to!r} should be a list of tracker names, one name, 'all' or 'none'.")
    for sink in c.report_to:
        if isinstance(sink, str):
            _choices("report_to", sink, REPORT_SINKS)
        elif not callable(getattr(sink, "log", None)):
            raise ConfigError(f"report_to entry {sink!r} is neither a tracker name nor a tracker object "
                              "(an accelerate.tracking.GeneralTracker).")
    _check_algorithm_options(c)
    _check_rollout_options(c)
    _check_tool_options(c)
    _check_schedule_and_eval(c)

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
    _finite(c, "num_train_epochs", 0, low_open=True)
    _finite(c, "learning_rate", 0, hint=" Typical GRPO values: 1e-6 to 1e-5.")
    _finite(c, "warmup_ratio", 0, 1)
    if c.warmup_ratio == 1 or c.warmup_steps < 0:
        raise ConfigError(f"warmup_ratio={c.warmup_ratio} must be below 1 and warmup_steps={c.warmup_steps} >= 0.")
    _finite(c, "max_grad_norm", 0, hint=" 0 turns clipping off; 1.0 is usual.")
    _check_optimizer(c)
    _finite(c, "temperature", 0, low_open=True, hint=" GRPO samples a group of different completions; for "
            "near-greedy sampling use a small value such as 0.1.")
    if c.temperature < MIN_TEMPERATURE:
        raise ConfigError(
            f"temperature={c.temperature} is too close to 0: sampling is then greedy, so the completions of a group "
            "are identical, and the log-probs divide the logits by it, so gradients grow as 1/temperature. GRPO "
            f"needs at least {MIN_TEMPERATURE}; for near-greedy sampling use a small value such as 0.1."
        )
    _finite(c, "top_p", 0, 1, low_open=True)
    if c.top_k < 0:
        raise ConfigError(f"top_k={c.top_k} must be >= 0 (0 disables).")
    _finite(c, "min_p", 0, 1)
    if c.min_p == 1:
        raise ConfigError(f"min_p={c.min_p} must be below 1 (it would drop every token but the likeliest).")
    _finite(c, "repetition_penalty", 0, low_open=True, hint=" 1.0 disables it.")
    if c.reward_weights is not None and any(
            isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) for w in c.reward_weights):
        raise ConfigError(f"reward_weights={c.reward_weights} must be a list of finite numbers.")
    c.check_geometry(num_processes=1)


def _check_schedule_and_eval(c: GRPOConfig) -> None:
    if c.load_best_model_at_end and c.eval_strategy == "no":
        raise ConfigError("load_best_model_at_end=True needs periodic evaluation: set eval_strategy to steps or epoch.")
    for name in ("eval_steps", "per_device_eval_batch_size", "num_generations_eval", "num_completions_to_print"):
        value = getattr(c, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{name}={value!r} must be a positive whole number or null.")
    for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs", "chat_template_kwargs"):
        value = getattr(c, name)
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{name}={value!r} must be a mapping of argument: value.")
    import torch
    from transformers import get_scheduler

    dummy = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:  # the schedule's own checks, now rather than after the model has loaded
        get_scheduler(c.lr_scheduler_type, dummy, num_warmup_steps=1, num_training_steps=10,
                      scheduler_specific_kwargs=dict(c.lr_scheduler_kwargs))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"lr_scheduler_type={c.lr_scheduler_type!r} with lr_scheduler_kwargs={c.lr_scheduler_kwargs}: {exc}"
        ) from exc


MIN_TEMPERATURE = 0.01  # below it sampling is greedy in effect and 1/temperature scales the gradients


def _check_optimizer(c: GRPOConfig) -> None:
    """AdamW's options, checked with the rest, before any model loads."""
    _finite(c, "weight_decay", 0)
    _finite(c, "adam_beta1", 0, 1, hint=" 0.9 is usual.")
    _finite(c, "adam_beta2", 0, 1, hint=" 0.999 is usual.")
    for name in ("adam_beta1", "adam_beta2"):
        if getattr(c, name) == 1:
            raise ConfigError(f"{name}=1 must be below 1: the moment estimate would never move from 0.")
    _finite(c, "adam_epsilon", 0, low_open=True, hint=" 1e-8 is usual.")


def _finite(c: GRPOConfig, name: str, low: float | None = None, high: float | None = None,
            low_open: bool = False, hint: str = "") -> None:
    """`name` must be a finite number in [low, high] ((low, high] with low_open); None passes."""
    value = getattr(c, name)
    if value is None:
        return
    ok = math.isfinite(value) and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or value <= high)
    if not ok:
        bound = f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ConfigError(f"{name}={value} must be a finite number in {bound}.{hint}")


def _check_algorithm_options(c: GRPOConfig) -> None:
    """Loss, KL, entropy, reference-sync and advantage options, and how they combine."""
    try:
        objective, aggregation = c.resolved_loss
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    entry = POLICY_OBJECTIVES[objective]
    if entry.uses_level is False and c.importance_sampling_level != "token":
        raise ConfigError(
            f"The {objective} objective builds its own sequence weight, so importance_sampling_level="
            f"{c.importance_sampling_level!r} would have no effect; leave it at 'token'."
        )
    if isinstance(entry.uses_level, tuple) and c.importance_sampling_level not in entry.uses_level:
        raise ConfigError(
            f"The {objective} objective needs importance_sampling_level in {list(entry.uses_level)}; "
            f"set importance_sampling_level: {entry.uses_level[0]}."
        )
    if not ADVANTAGE_ESTIMATORS[c.advantage_estimator].uses_scale_rewards and c.scale_rewards != "group":
        raise ConfigError(
            f"advantage_estimator={c.advantage_estimator!r} fixes its own scale (the batch std of the centred "
            f"rewards), so scale_rewards={c.scale_rewards!r} would have no effect; leave scale_rewards at 'group'."
        )
    _finite(c, "epsilon", 0, 1, hint=" The ratio is clipped below at 1 - epsilon.")
    if c.epsilon >= 1 and objective != "gmpo":
        raise ConfigError(f"epsilon={c.epsilon} must be below 1: the ratio is clipped below at 1 - epsilon.")
    _finite(c, "epsilon_high", 0, hint=" DAPO uses 0.28.")
    if c.delta is not None and not (math.isfinite(c.delta) and c.delta > 1 + c.resolved_epsilon_high):
        raise ConfigError(
            f"delta={c.delta} must exceed 1 + epsilon_high = {1 + c.resolved_epsilon_high}, or the cap would "
            "clip inside the trust region; INTELLECT-2 uses 4."
        )
    for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
        _finite(c, name, 0, low_open=True)
    for name in ("vespo_k_pos", "vespo_k_neg"):
        _finite(c, name, 0)
    _finite(c, "off_policy_mask_threshold", 0, low_open=True, hint=" DeepSeek-V3.2's delta, e.g. 0.5; null disables.")
    _finite(c, "beta", 0, hint=" 0 disables the KL penalty; DeepSeekMath used 0.04.")
    if c.kl_in_reward and c.beta == 0:
        raise ConfigError("kl_in_reward=True needs beta > 0: beta is the coefficient of the KL subtracted from the reward.")
    if c.sync_ref_model and c.beta == 0:
        raise ConfigError("sync_ref_model=True needs beta > 0: with beta = 0 there is no reference model to sync.")
    _finite(c, "ref_model_mixup_alpha", 0, 1, low_open=True)
    if c.ref_model_sync_steps < 1:
        raise ConfigError(f"ref_model_sync_steps={c.ref_model_sync_steps} must be at least 1.")
    _finite(c, "top_entropy_quantile", 0, 1, hint=" 1.0 keeps every token; the paper recommends 0.2.")
    _finite(c, "entropy_coef", hint=" 0 disables the entropy bonus.")
    _finite(c, "entropy_coef_min", 0)
    _finite(c, "entropy_coef_max", c.entropy_coef_min, hint=" It must be at least entropy_coef_min.")
    _finite(c, "entropy_coef_delta", 0, low_open=True)
    _finite(c, "entropy_target", 0)
    if c.dynamic_sampling_max_rounds < 1:
        raise ConfigError(f"dynamic_sampling_max_rounds={c.dynamic_sampling_max_rounds} must be at least 1.")


def _check_tool_options(c: GRPOConfig) -> None:
    from grpokit.tools import TOOL_CALL_FORMATS

    if c.max_tool_calling_iterations is not None and c.max_tool_calling_iterations < 0:
        raise ConfigError(f"max_tool_calling_iterations={c.max_tool_calling_iterations} must be 0 or more (null: "
                          "no limit but max_completion_length).")
    _finite(c, "tool_timeout", 0, low_open=True, hint=" Seconds one tool call may take, e.g. 10.")
    if not isinstance(c.tool_call_format, str):
        if not callable(getattr(c.tool_call_format, "parse", None)):
            raise ConfigError(f"tool_call_format={c.tool_call_format!r} is neither a format name nor an object with "
                              "a parse(text) method.")
    elif ":" not in c.tool_call_format:
        _choices("tool_call_format", c.tool_call_format, TOOL_CALL_FORMATS.names())
    if c.environment_factory is not None and ":" not in c.environment_factory:
        raise ConfigError(f"environment_factory={c.environment_factory!r} must be an import path 'pkg.module:factory'.")


def _check_rollout_options(c: GRPOConfig) -> None:
    from grpokit.rollout.engine import engine_names

    if ":" not in c.rollout_engine:
        _choices("rollout_engine", c.rollout_engine, engine_names())
    if c.use_vllm and c.rollout_engine not in ("local", "vllm"):
        raise ConfigError(
            f"use_vllm=True and rollout_engine={c.rollout_engine!r} name two different engines; set only one."
        )
    if c.generation_kwargs.get("do_sample", True) is not True:
        raise ConfigError(
            f"generation_kwargs has do_sample={c.generation_kwargs['do_sample']!r}: GRPO learns from differences "
            "between sampled completions, and greedy decoding makes the G completions of a prompt identical. Remove "
            "do_sample (sampling is always on); lower temperature for less random completions."
        )
    if c.generation_kwargs.get("num_beams", 1) != 1:
        raise ConfigError(
            f"generation_kwargs has num_beams={c.generation_kwargs['num_beams']!r}: beam search keeps the likeliest "
            "continuations instead of sampling, so the completions would not be samples of the policy the loss "
            "assumes. Remove num_beams."
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


@lru_cache(maxsize=1)
def _type_hints() -> dict[str, Any]:
    return typing.get_type_hints(GRPOConfig)


def _field_type(name: str) -> Any:
    return _type_hints()[name]


def coerce_option(name: str, value: Any) -> Any:
    """Check `value` against the field's annotation; command-line strings are parsed as YAML scalars first."""
    hint = _field_type(name)
    if isinstance(value, str) and not _matches(value, hint):  # "no" stays "no" where a string is valid
        parsed = yaml.safe_load(value) if value != "" else None
        value = parsed if parsed is not None or _allows_none(hint) else value
    value = trl_value_form(name, value)
    if not _matches(value, hint):
        raise ConfigError(f"{name}={value!r} should be {_describe(hint)}.")
    origin = typing.get_origin(hint)
    if hint is float or (origin in _UNION_TYPES and float in typing.get_args(hint)):
        if isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
    return value


def _report_to_list(value: Any) -> Any:
    """report_to in any of TRL's forms -> a list of tracker names (other objects are left for the checks)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, list):
        return value
    if value in (["none"], ["no"]):
        return []
    if "all" in value:
        installed = [name for name in REPORT_SINKS if tracker_installed(name)]
        return installed + [v for v in value if v != "all" and v not in REPORT_SINKS]
    return value


_DICT_OPTIONS = ("lr_scheduler_kwargs", "generation_kwargs", "model_init_kwargs", "loss_kwargs", "reward_model_kwargs")


def trl_value_form(name: str, value: Any) -> Any:
    """TRL's value forms -> grpokit's: report_to as a string, "none" or "all"; scale_rewards True/False;
    a number written as a string ("1e-5", which YAML reads as a string) for a float option."""
    if name == "report_to":
        return _report_to_list(value)
    if name == "tools" and isinstance(value, str):  # --tools calculator,pkg.mod:fn
        return [v.strip() for v in value.split(",") if v.strip()]
    if value is None and name in _DICT_OPTIONS:  # TRL's default for these is None
        return {}
    if name == "scale_rewards" and isinstance(value, bool):
        return "group" if value else "none"
    if name == "scale_rewards" and isinstance(value, str) and value.lower() in ("true", "false"):
        return "group" if value.lower() == "true" else "none"
    if isinstance(value, str) and _takes_float(name):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _takes_float(name: str) -> bool:
    hint = _field_type(name)
    return hint is float or (typing.get_origin(hint) in _UNION_TYPES and float in typing.get_args(hint))


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

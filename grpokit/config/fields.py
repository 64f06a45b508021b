"""GRPOConfig: every training option, each documented once by the docstring under its field.

Those docstrings are the single source of documentation: `field_docs()` reads them from this file's source and
`grpo train --help` prints them, followed by the option's choices read from their registry (so a docstring never
lists them by hand). Option names follow TRL's GRPOConfig where the meaning is the same. The checks
(grpokit.config.checks) run in `__post_init__`, before any model is loaded, and every message says how to fix the
value; the value forms TRL, YAML and the command line use are read by grpokit.config.forms. What the class derives
from its fields (`__post_init__`, the resolved_* values, check_geometry, from_dict) is ResolvedOptions'
(grpokit/config/resolved.py); the bounds several Ranges share are in grpokit/config/bounds.py.

The annotations are what HfArgumentParser (TRL's TrlParser) parses from a command line, so a TRL script parses
GRPOConfig beside its ScriptArguments and ModelConfig: a mapping option is `dict | str | None` as in
TrainingArguments (JSON text on a command line), `tools` a list of names. The types a value must have once read
(a mapping, tool functions, a format object) are forms.VALUE_TYPES. TRL's options that grpokit does not define
are fields too (`with_trl_fields`, grpokit/config/decorators.py, after grpokit's own), at TRL's defaults: accepted
and ignored, or accepted at their default only (grpokit/config/trl_compat.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any

# The bounds and decorators live in bounds.py and decorators.py; the field annotations below read the bounds by name
# (HfArgumentParser and checks.numeric_fields evaluate them in this module), and every name stays importable here.
from grpokit.config.bounds import (  # noqa: F401
    AUTO_TOKEN_BUDGET,
    MAX_BATCH,
    MAX_GENERATION_BATCH,
    MAX_STEPS,
    MAX_TOKENS,
    Steps,
)
from grpokit.config.checks import MIN_TEMPERATURE, Range
from grpokit.config.decorators import accepts_trl_options, with_trl_fields
from grpokit.config.process import ProcessFacts
from grpokit.config.resolved import ResolvedOptions
from grpokit.config.trl_compat import TRL_FIELDS, trl_option_doc

_TEMPERATURE_HINT = ("Below 0.01 sampling is greedy in effect (a group's completions are identical) and the "
                     "log-probs, which divide the logits by it, give gradients that grow as 1/temperature; for "
                     "near-greedy sampling use a small value such as 0.1.")


@accepts_trl_options
@dataclass
@with_trl_fields
class GRPOConfig(ResolvedOptions, ProcessFacts):
    """Every training option; the docstring under each field is its documentation (`grpo train --help`).
    The checks of __post_init__, the resolved_* values, check_geometry and from_dict: ResolvedOptions (resolved.py).
    TrainingArguments' process properties (device, n_gpu, world_size, get_process_log_level(), ...): ProcessFacts."""

    # --- output and bookkeeping ---
    output_dir: str = "outputs/grpo"
    """Folder for metrics.jsonl, completions.jsonl, checkpoints and the final model."""
    overwrite_output_dir: bool = False
    """Allow training into an output_dir that already holds checkpoints (they are left in place)."""
    resume_fallback: bool = False
    """With resume_from_checkpoint=True (--resume): when the newest checkpoint fails verification (a file missing,
    resized or changed since it was saved), resume from the newest older one that verifies, with a warning,
    instead of stopping with an error that names the damaged file."""
    seed: Annotated[int, Range(0, 2**32 - 1, hint="numpy takes 32-bit seeds.")] = 42
    """Seed for python, numpy, torch and the sampling generator; the same seed gives the same run on CPU."""
    logging_steps: Steps = 10
    """Write a metrics.jsonl row every this many optimizer steps, and at the last step: the mean of each metric
    over those steps (as TRL, whose default this is), with the last step's learning rate and counters. 1 logs every
    step (the demos do)."""
    logging_first_step: bool = False
    """Also log the first optimizer step when logging_steps > 1."""
    run_name: str | None = None
    """Name of the run for the trackers of report_to; default: the output_dir's folder name."""
    log_completions: bool = True
    """Write sampled completions with their rewards and advantages to completions.jsonl."""
    completions_logging_steps: Steps = 10
    """Write completions.jsonl rows every this many optimizer steps (when log_completions)."""
    report_to: list[str] | str = field(default_factory=list)
    """Trackers that also get every metrics row (metrics.jsonl is always written): a list of tracker names or
    tracker objects (accelerate.tracking.GeneralTracker), one name, "all" (every installed one) or "none"; each
    named one must be installed."""
    num_completions_to_print: Annotated[int | None, Range(1, MAX_GENERATION_BATCH)] = None
    """At each logged step, print this many sampled completions (prompt, completion, rewards) to stderr."""
    disable_tqdm: bool = False
    """Print one log line per logged step instead of a progress bar (also automatic when stderr is not a TTY)."""

    # --- schedule and optimiser ---
    max_steps: Annotated[int, Range(1, MAX_STEPS, also=(-1,), hint="-1 uses num_train_epochs.")] = -1
    """Number of optimizer steps; -1 derives it from num_train_epochs and the dataset size."""
    num_train_epochs: Annotated[float, Range(0, 1e6, low_open=True)] = 1.0
    """Passes over the prompts when max_steps = -1 (each pass samples num_generations completions per prompt)."""
    learning_rate: Annotated[float, Range(0, 1, hint="Typical GRPO values: 1e-6 to 1e-5.")] = 1e-6
    """Peak AdamW learning rate."""
    lr_scheduler_type: str = "linear"
    """The learning-rate schedule after warm-up, by its name in transformers' get_scheduler (linear and cosine
    decay to 0)."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = field(default_factory=dict)
    """Extra arguments of the schedule, e.g. {"min_lr_rate": 0.1} for cosine_with_min_lr, {"num_cycles": 2} for
    cosine_with_restarts (as transformers' lr_scheduler_kwargs)."""
    warmup_steps: Annotated[int, Range(0, MAX_STEPS)] = 0
    """Optimizer steps of linear warm-up from 0 to learning_rate (wins over warmup_ratio when > 0)."""
    warmup_ratio: Annotated[float, Range(0, 1, high_open=True)] = 0.0
    """Fraction of max_steps used for warm-up when warmup_steps = 0."""
    weight_decay: Annotated[float, Range(0, 10, hint="0.0 to 0.1 is usual.")] = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: Annotated[float, Range(0, 1, high_open=True,
                                        hint="0.9 is usual (at 1 the moment estimate never moves from 0).")] = 0.9
    """AdamW beta1."""
    adam_beta2: Annotated[float, Range(0, 1, high_open=True,
                                        hint="0.999 is usual (at 1 the moment estimate never moves from 0).")] = 0.999
    """AdamW beta2."""
    adam_epsilon: Annotated[float, Range(0, 1, low_open=True, hint="1e-8 is usual.")] = 1e-8
    """AdamW epsilon."""
    max_grad_norm: Annotated[float, Range(0, None, hint="0 turns clipping off; 1.0 is usual.")] = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping (the norm is still logged)."""
    max_consecutive_nonfinite_steps: Steps = 3
    """An optimizer step whose loss or gradient norm is NaN/inf is skipped: gradients are dropped and neither the
    optimizer nor the learning-rate schedule steps (logged as nonfinite_skipped, and nonfinite_skips in total);
    after this many skipped steps in a row training stops with an error."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about 30% more compute."""
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    """Arguments of model.gradient_checkpointing_enable (default {"use_reentrant": False})."""
    bf16: bool = False
    """Run the rollout, the log-prob passes and the update's forward and backward under bfloat16 autocast (CPU or
    GPU). Weights, gradients and optimizer state stay fp32, and so do the log-softmax normaliser, the loss and
    the sampler's probabilities. Faster only where the hardware has bf16 matmuls (GPUs; CPUs with AMX or
    AVX512-BF16); on other CPUs it is slower than fp32 (benchmarks/README.md)."""

    # --- batch geometry (counts are completions, as in TRL) ---
    per_device_train_batch_size: Annotated[int, Range(1, MAX_BATCH)] = 8
    """Completions per micro-batch on each process."""
    gradient_accumulation_steps: Annotated[int, Range(1, MAX_BATCH)] = 1
    """Micro-batches whose gradients are summed into one optimizer step."""
    padding_free: bool = True
    """The log-prob passes forward the samples end to end in rows (per-sample positions, a block-causal mask, each
    distinct prompt once per row) instead of one padded row each: no arithmetic on padding, and shared prompts
    forwarded once in every mode (DDP, FSDP, gradient checkpointing, LoRA). Exact (the same values up to the order
    of floating-point sums). Used for a pass whose packed rows forward at most 0.8 of the padded positions, where
    the model hands over hidden states and reads a custom mask (sdpa or eager attention, no sliding window);
    other passes and models take the padded path (docs/performance.md)."""
    token_budget: Annotated[int | None, Range(-(2**31), 2**31 - 1)] = None
    """TRL AsyncGRPO's name: tokens forwarded at once (rows x row width, each prompt counted once per row) in the
    log-prob passes; the step's completions are regrouped into as many forwards as the budget needs, so peak
    memory follows the budget, not the longest sample or per_device_train_batch_size. The loss is unchanged by the
    grouping: every aggregation is computed over the micro-batches of per_device_train_batch_size as without it.
    None (the default): automatic where the regrouping is exact (padding_free, top_entropy_quantile 1.0, a
    built-in policy objective or one registered per_sample, a linear loss aggregation), the longest sample the
    options allow (max_prompt_length + max_completion_length, as TRL AsyncGRPO's default max_model_len) but at
    least AUTO_TOKEN_BUDGET (2048) tokens, grown to a longer sample when prompts are not truncated; elsewhere one
    forward per micro-batch. <= 0 as in TRL: one forward per micro-batch. A number: that budget; it needs
    padding_free and room for the longest prompt + completion (a longer sample stops the run with an error; TRL
    drops it)."""
    num_generations: Annotated[int, Range(2, MAX_BATCH, hint="GRPO compares completions within a group, so it "
                                                    "needs at least 2 per prompt (8 or 16 is typical).")] = 8
    """G: completions sampled per prompt; advantages are computed within each group of G."""
    steps_per_generation: Annotated[int | None, Range(1, MAX_BATCH)] = None
    """Micro-batches of per_device_train_batch_size in one generation batch (default gradient_accumulation_steps).
    As in TRL, optimizer steps take gradient_accumulation_steps micro-batches in turn, going through each generation
    batch num_iterations times; when they do not line up, a step's last micro-batches come from the next
    generation batch."""
    generation_batch_size: Annotated[int | None, Range(1, MAX_GENERATION_BATCH)] = None
    """Completions per generation on all processes together; default per_device_train_batch_size x processes x
    steps_per_generation. Set this or steps_per_generation, not both."""
    num_iterations: Annotated[int, Range(1, 1024)] = 1
    """mu: optimisation passes over each generation batch; > 1 computes old log-probs once per generation."""
    shuffle_dataset: bool = True
    """Shuffle the prompt order each epoch (seeded)."""

    # --- generation ---
    max_prompt_length: Annotated[int | None, Range(1, MAX_TOKENS)] = 512
    """Prompts longer than this many tokens are an error (None: only the model's context limit applies)."""
    max_completion_length: Annotated[int, Range(1, MAX_TOKENS)] = 256
    """Maximum tokens generated per completion."""
    temperature: Annotated[float, Range(MIN_TEMPERATURE, 100, hint=_TEMPERATURE_HINT)] = 1.0
    """Sampling temperature; also divides the logits when log-probs are computed for the loss."""
    top_p: Annotated[float, Range(0, 1, low_open=True)] = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: Annotated[int, Range(0, MAX_TOKENS, hint="0 disables.")] = 0
    """Keep only the k most likely tokens; 0 disables."""
    min_p: Annotated[float | None, Range(0, 1, high_open=True)] = None
    """Drop tokens whose probability is below min_p x the top token's; None disables."""
    repetition_penalty: Annotated[float, Range(0, 100, low_open=True, hint="1.0 disables it.")] = 1.0
    """Penalise tokens already in the prompt or completion (> 1 discourages repetition)."""
    generation_kwargs: dict[str, Any] | str | None = field(default_factory=dict)
    """Extra keyword arguments passed to `model.generate` (or vLLM's SamplingParams), e.g. {"min_new_tokens": 64};
    they win over the above. do_sample=True is accepted and changes nothing (sampling is always on)."""
    mask_truncated_completions: bool = False
    """Exclude completions that hit max_completion_length without EOS from the loss (DAPO)."""

    # --- rollout engine (docs/vllm.md) ---
    rollout_engine: str = "local"
    """What generates the completions: a registered engine (grpokit.rollout.register_rollout_engine) or an import
    path "pkg.module:factory". The built-in local engine is grpokit's decode loop in this process (tokens depend
    only on (seed, sample id, position), exact resume); use_vllm=True picks the vLLM one (docs/vllm.md)."""
    use_vllm: bool = False
    """Generate with vLLM (install: pip install -e ".[vllm]"); vllm_mode picks colocate or server."""
    vllm_mode: str = "colocate"
    """Where vLLM runs: a vllm.LLM inside each training process with weights pushed in memory (colocate), or a
    separate server (start one with `grpo vllm-serve --model PATH`) with weights pushed through
    vllm_server_weights_dir."""
    vllm_server_base_url: str | None = None
    """Server mode: the server's base URL, e.g. "http://10.0.0.5:8000"; wins over vllm_server_host and _port."""
    vllm_server_host: str = "0.0.0.0"
    """Server mode: host of the vLLM server (when vllm_server_base_url is not set)."""
    vllm_server_port: Annotated[int, Range(1, 65535)] = 8000
    """Server mode: port of the vLLM server (when vllm_server_base_url is not set)."""
    vllm_server_timeout: Annotated[float, Range(0, 86400, low_open=True)] = 240.0
    """Server mode: seconds to wait for the server to answer /health at start, and for any one request."""
    vllm_server_weights_dir: str | None = None
    """Server mode: folder, readable by the server, where each weight push writes model.safetensors before the
    server reloads it; None: output_dir/.vllm-weights (right for a server on this machine or a shared disk)."""
    vllm_gpu_memory_utilization: Annotated[float, Range(0, 1, low_open=True)] = 0.3
    """Colocate mode on a GPU: fraction of GPU memory vLLM may take (weights + KV cache). On a CPU the KV cache is
    sized to the generation batch instead, and this option is not used."""
    vllm_tensor_parallel_size: Annotated[int, Range(1, 1024)] = 1
    """Colocate mode: GPUs one vLLM engine spreads the model over."""
    vllm_enable_sleep_mode: bool = False
    """Colocate mode on a GPU: offload vLLM's weights and free its KV cache while the trainer updates (needs CUDA)."""
    vllm_importance_sampling_correction: bool = True
    """With any engine but "local": weight each token's policy-gradient term by the ratio p_trainer / p_sampler of
    the sampled token (trainer log-probs recomputed at generation), corrected per vllm_importance_sampling_mode;
    the sampling/* metrics then report the mismatch (docs/vllm.md says which values are healthy)."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """How the mismatch ratio is constrained: one ratio per token (token_*) or one per completion (sequence_*),
    and ratios outside [clip_min, clip_max] clipped to the bounds (*_truncate) or set to 0 (*_mask); or an import
    path to a mode of your own. Formulas: grpokit/algorithms/mismatch.py."""
    vllm_importance_sampling_clip_max: Annotated[float | None, Range(0, 1e6, low_open=True)] = 3.0
    """Upper bound C_max on the mismatch ratio (None: no upper bound)."""
    vllm_importance_sampling_clip_min: Annotated[float | None, Range(0, 1e6, low_open=True)] = None
    """Lower bound C_min on the mismatch ratio (None: no lower bound)."""

    # --- asynchronous rollouts (docs/async.md; TRL's AsyncGRPOConfig names) ---
    max_staleness: Annotated[int, Range(0, 1024)] = 0
    """Generate ahead of training: a batch may be sampled by weights at most this many weight versions older than
    the weights that train on it (a version: weight_sync_steps optimizer steps). 0: synchronous, each batch
    generated by the weights that train on it. k > 0: a producer thread generates the next batches while this one
    trains, with a copy of the policy's weights (one more copy in memory); the stale samples are corrected as in
    decoupled PPO (the mismatch weights of vllm_importance_sampling_correction against the sampler's log-probs,
    the clip ratio against the current weights). TRL's AsyncGRPO defaults to 4; 1 overlaps generation and
    training completely."""
    weight_sync_steps: Steps = 1
    """Asynchronous rollouts: optimizer steps between two weight versions given to the producer (and pushed to the
    engine). Only with max_staleness > 0."""
    max_inflight_tasks: Annotated[int, Range(-1, 2**31 - 1)] = -1
    """Completions sent to the rollout engine in one call (a multi-turn loop: per turn); -1: all completions of
    a generation batch at once. Bounds how many parallel requests a server or parallel environments take."""
    queue_maxsize: Annotated[int, Range(1, 2**31 - 1)] = 1024
    """Asynchronous rollouts: completions made ahead and waiting for the learner; the producer makes no new batch
    while more are waiting (it always may make one). Lifted while an evaluation or a checkpoint waits for the
    batches already-published weights make."""
    heartbeat_stale_after_s: Annotated[float, Range(0, 86400, low_open=True)] = 300.0
    """Asynchronous rollouts: seconds the producer may show no progress while the learner waits for it (no engine,
    reward or tool call finishing, no computing in its thread, no answer from the vLLM server it waits on) before
    the learner stops the run with an error naming what it was doing (docs/async.md)."""

    # --- loss (formulas: grpokit/algorithms/losses.py and docs/algorithms.md) ---
    loss_type: str = "dapo"
    """TRL's name: a loss aggregation (how per-token losses become one number), or a policy objective, which then
    comes with its paper's aggregation."""
    policy_objective: str | None = None
    """The per-token objective when loss_type names an aggregation (None: "clip", PPO-clip as in GRPO); lets any
    objective be combined with any aggregation."""
    loss_kwargs: dict[str, Any] | str | None = field(default_factory=dict)
    """Settings for a policy objective or aggregation registered from your own code (LossSettings.extra)."""
    importance_sampling_level: str = "token"
    """Importance ratio per token (GRPO), one per sequence from the mean log-ratio (GSPO), or GSPO's sequence value
    with a per-token gradient (sequence_token, GSPO-token)."""
    epsilon: Annotated[float, Range(0, 1, hint="The ratio is clipped below at 1 - epsilon.")] = 0.2
    """Lower clip range: the ratio is clipped below at 1 - epsilon (gmpo: the log-ratio at -epsilon)."""
    epsilon_high: Annotated[float | None, Range(0, 10, hint="DAPO uses 0.28.")] = None
    """Upper clip range: clipped above at 1 + epsilon_high (DAPO clip-higher: 0.28); None = epsilon. For cispo it is
    the largest importance weight itself (ScaleRL: 5.0); for gmpo the log-ratio bound."""
    delta: Annotated[float | None, Range(1, 1000, low_open=True, hint="INTELLECT-2 uses 4.")] = None
    """Optional cap on the unclipped ratio (two-sided clipping, INTELLECT-2); must exceed 1 + epsilon_high."""
    sapo_temperature_pos: Annotated[float, Range(0, 100, low_open=True)] = 1.0
    """sapo: temperature of the soft gate for tokens with a positive advantage."""
    sapo_temperature_neg: Annotated[float, Range(0, 100, low_open=True)] = 1.05
    """sapo: temperature of the soft gate for tokens with a non-positive advantage."""
    vespo_k_pos: Annotated[float, Range(0, 100)] = 2.0
    """vespo: power k of the gamma weight for A >= 0 (how fast weights below 1 are damped)."""
    vespo_lambda_pos: Annotated[float, Range(0, 100, low_open=True)] = 3.0
    """vespo: decay lambda of the gamma weight for A >= 0 (how fast weights above 1 are damped)."""
    vespo_k_neg: Annotated[float, Range(0, 100)] = 3.0
    """vespo: power k of the gamma weight for A < 0."""
    vespo_lambda_neg: Annotated[float, Range(0, 100, low_open=True)] = 2.0
    """vespo: decay lambda of the gamma weight for A < 0."""
    off_policy_mask_threshold: Annotated[float | None, Range(
        0, 100, low_open=True, hint="DeepSeek-V3.2's delta, e.g. 0.5; null disables.")] = None
    """DeepSeek-V3.2's off-policy sequence mask: a completion with a negative advantage whose mean log-ratio
    log pi_sampler - log pi_theta exceeds this (e.g. 0.5) leaves the policy term; None disables."""
    beta: Annotated[float, Range(0, 100, hint="0 disables the KL penalty; DeepSeekMath used 0.04.")] = 0.0
    """KL coefficient (DeepSeekMath: 0.04; DeepSeek-R1: 0.001); 0 loads no reference model."""
    kl_estimator: str = "k3"
    """How KL(pi_theta || pi_ref) is estimated per token (formulas: grpokit/algorithms/kl.py)."""
    kl_in_reward: bool = False
    """Put the KL in the reward instead of the loss: each completion's reward gets -beta x its summed per-token
    KL (measured at generation) before advantages are computed, as one more reward term."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL in the loss by the importance weight (with its gradient), so its gradient is the
    unbiased reverse-KL gradient (DeepSeek-V3.2; TRL's default)."""
    top_entropy_quantile: Annotated[float, Range(0, 1, hint="1.0 keeps every token; the paper recommends 0.2.")] = 1.0
    """Train the policy term only on the tokens whose entropy is in the top this fraction of the micro-batch's
    counted tokens on all processes ("Beyond the 80/20 rule" recommends 0.2); 1.0 keeps all tokens."""
    entropy_coef: Annotated[float, Range(-10, 10, hint="0 disables the entropy bonus; 0.001 to 0.01 is usual.")] = 0.0
    """Entropy bonus: the loss gets -entropy_coef x the mean per-token entropy (over the tokens the policy term
    trains on); with use_adaptive_entropy, the starting coefficient."""
    use_adaptive_entropy: bool = False
    """Skywork-OR1's adaptive entropy control: after each optimizer step the coefficient moves by
    entropy_coef_delta, up when the step's entropy was at or below entropy_target and down otherwise (within
    [entropy_coef_min, entropy_coef_max]); the bonus applies only while the entropy is at or below the target."""
    entropy_coef_min: Annotated[float, Range(0, 10)] = 0.0
    """Adaptive entropy control: lowest coefficient."""
    entropy_coef_max: Annotated[float, Range(0, 10)] = 1.0
    """Adaptive entropy control: highest coefficient."""
    entropy_coef_delta: Annotated[float, Range(0, 10, low_open=True)] = 0.005
    """Adaptive entropy control: change of the coefficient per optimizer step."""
    entropy_target: Annotated[float, Range(0, 100)] = 0.2
    """Adaptive entropy control: target mean per-token entropy (nats), over the tokens the policy term trains on."""
    sync_ref_model: bool = False
    """TR-DPO's reference sync: every ref_model_sync_steps optimizer steps, pi_ref <- alpha pi_theta +
    (1 - alpha) pi_ref (needs beta > 0)."""
    ref_model_mixup_alpha: Annotated[float, Range(0, 1, low_open=True)] = 0.6
    """alpha of the reference sync (1.0 copies the policy)."""
    ref_model_sync_steps: Steps = 512
    """Optimizer steps between reference syncs."""

    # --- tools and environments: multi-turn rollouts (docs/tools.md) ---
    tools: list[str] = field(default_factory=list)
    """Tools the model may call, by name (grpokit.tools.TOOLS), import path "pkg.module:function" or (from
    Python) the function itself: type hints and a docstring with an Args: section.
    Added to GRPOTrainer(tools=...); on the command line a comma-separated list. Any tool or environment turns
    each rollout into an episode of several turns."""
    environment_factory: str | None = None
    """Import path "pkg.module:factory" of an environment factory (grpokit/rollout/environments.py has the
    contract); the YAML form of GRPOTrainer(environment_factory=...), which it may not be given together with."""
    max_tool_calling_iterations: Annotated[int | None, Range(0, 10**6,
                                                             hint="null: no limit but max_completion_length.")] = None
    """Rounds of tool results (or environment answers) per episode; None: only max_completion_length, which
    bounds the whole transcript (tool tokens included), limits them. A call past the limit ends the episode."""
    tool_call_format: str = "auto"
    """How the model writes tool calls: a format of grpokit.tools.TOOL_CALL_FORMATS (grpokit/tools/formats.py shows
    each one's syntax), an import path, or (from Python) a format object with parse(text) and
    render_results(results). "auto" reads calls as the tokenizer's chat template writes them: the tokenizer's own
    response parser ("schema") when it has one, else the registered format that reads back a call the template
    renders, else "qwen" (a template that renders no tool calls, or plain-text prompts); the pick is logged once
    (grpokit/tools/detect.py)."""
    tool_timeout: Annotated[float, Range(0, 86400, low_open=True,
                                         hint="Seconds one tool call may take, e.g. 10.")] = 10.0
    """Seconds one tool call may take; a slower call becomes an error message the model reads (and, with
    tool_isolation "process", the call's worker and everything it started are killed)."""
    tool_isolation: str = "process"
    """Where standalone tools run: "process", a worker forked from the trainer, killed at tool_timeout, so a hung,
    spinning or leaking tool costs the trainer nothing (what a tool changes in Python memory stays in the worker);
    "inline", the trainer's own thread, as environment methods run: no timeout, for tools that need the trainer's
    live state (a model on the GPU, which a forked process cannot use; state that reward functions read).
    docs/tools.md, "Where tools run"."""

    # --- rewards and advantages ---
    reward_weights: list[float] | None = None
    """One weight per reward function, in order; None weights each 1.0."""
    advantage_estimator: str = "grpo"
    """Baseline and scale of the advantages (each estimator's formula: grpokit/algorithms/advantages.py and
    docs/algorithms.md)."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """Weighted sum of rewards then the estimator, or the estimator on each reward then the weighted sum."""
    scale_rewards: str = "group"
    """Divide centred rewards by the group std, the batch std, or nothing (Dr. GRPO)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal (no learning signal) are dropped and more
    prompts are sampled until the generation batch is full of informative groups."""
    dynamic_sampling_max_rounds: Annotated[int, Range(1, 10**4)] = 8
    """Dynamic sampling: most generation rounds for one batch; after them the batch is topped up with dropped
    groups (with a warning and the dynamic_sampling/filled_with_flat metric)."""
    reward_error_policy: str = "raise"
    """A reward function that raises or returns a non-number: stop training, or score that sample None and count it."""
    reward_model_kwargs: dict[str, Any] | str | None = field(default_factory=dict)
    """Keyword arguments for reward models given as a path or hub name (e.g. {"batch_size": 16}); the device
    defaults to this process's device."""

    # --- checkpoints ---
    save_strategy: str = "no"
    """When to save checkpoint-<step>/: every save_steps optimizer steps, after each pass over the prompts, or
    never."""
    save_steps: Steps = 500
    """Optimizer steps between checkpoints when save_strategy = "steps"."""
    save_total_limit: Annotated[int | None, Range(1, MAX_STEPS)] = None
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
    eval_steps: Annotated[int | None, Range(1, MAX_STEPS)] = None
    """Optimizer steps between evaluations when eval_strategy = "steps" (default: logging_steps)."""
    eval_on_start: bool = False
    """Also evaluate before the first optimizer step (a baseline for the eval curves)."""
    per_device_eval_batch_size: Annotated[int | None, Range(1, MAX_GENERATION_BATCH)] = None
    """Completions generated at once during evaluation (default: the training generation batch)."""
    num_generations_eval: Annotated[int | None, Range(1, MAX_BATCH)] = None
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
    model_init_kwargs: dict[str, Any] | str | None = field(default_factory=dict)
    """Keyword arguments for `from_pretrained` (AutoModelForCausalLM, or AutoModelForImageTextToText for a
    vision-language model) when the model is a name or a path."""
    freeze_vision_tower: bool | None = None
    """A vision-language model's vision tower (`visual`, `vision_tower` or `vision_model`: the image encoder,
    with Qwen's merger): None (default) trains it in a full fine-tune (TRL's behaviour) and keeps a PEFT adapter
    off it (the adapter goes on the language model and projector, via LoraConfig.exclude_modules unless that is
    set); True freezes it in both; False puts the adapter's target modules in the tower too."""
    trust_remote_code: bool = False
    """Allow model and tokenizer code from the model's repository (from_pretrained's trust_remote_code)."""
    disable_dropout: bool = False
    """Set every dropout probability of the policy (and reference) to 0, so log-probs do not depend on dropout."""
    chat_template_kwargs: dict[str, Any] | str | None = None
    """Extra arguments of the tokenizer's apply_chat_template for conversational prompts, e.g.
    {"enable_thinking": False}."""
    use_cpu: bool = False
    """Train on the CPU even where a GPU is visible."""


@functools.lru_cache(maxsize=None)
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
    for name in TRL_FIELDS:
        docs.setdefault(name, trl_option_doc(name))
    return docs

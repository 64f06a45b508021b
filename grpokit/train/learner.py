"""The learner: the models, the optimizer and every pass through them.

    experience, prepared = learner.prepare(batch)        # ScoredBatch -> Experience, built once (learner_passes.py)
    stats = learner.step(experience, rows, entropy_coef)   # one optimizer step over micro-batches (learner_step.py)
    learner.save(folder, tokenizer), learner.load(folder)  # checkpoints (learner_state.py)
    learner.version, learner.weights()                     # for the rollout engine (this file, with the models)

It holds the policy (its PEFT adapter, if any), the reference model (only when beta != 0 and there is no adapter
to switch off), AdamW and the schedule, wrapped by accelerate (DDP with several processes), or, with fsdp /
fsdp_config or an accelerate FSDP config file, both models sharded with FSDP2 (grpokit/train/fsdp.py): every
micro-batch then reduce-scatters its gradients (no no_sync: gradients stay sharded), the gradient norm is the global
norm over the shards, checkpoints hold every process's own shards (grpokit/train/distcp.py), and the final and best
models are saved from their full state dict gathered on process 0. The log-prob passes
pack samples without padding where that saves, run each distinct prompt once, and never build (b, T, V) logits
(grpokit/passes/); token_budget regroups a step's samples into forwards of bounded
size with the loss unchanged, and token-separable losses run inside the head's chunks (docs/performance.md).
`version` counts the weights: every optimizer step that changed them, and a resume, bumps it.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, get_scheduler

from grpokit.algorithms import IS_CORRECTION_MODES, LossSettings, regroupable
from grpokit.config import ConfigError, GRPOConfig
from grpokit.errors import writing
from grpokit.models.kv_cache import causal_lm
from grpokit.models.loading import is_peft_model, is_vision_language, load_policy, reference_model
from grpokit.train.comm import Comm
from grpokit.train.fsdp import gathered_for_generation, is_gathered, lockstep_decoding, run_options, shard
from grpokit.train.images import freeze_tower, place_adapter
from grpokit.train.in_place import in_place_gradients
from grpokit.train.learner_passes import LearnerPasses, training_mask
from grpokit.train.learner_state import REFERENCE_FILE, LearnerState
from grpokit.train.learner_step import (FUSED_LOSS_MIN_HEAD, EntropyControl, LearnerStep, NonFiniteError,
                                        linear_aggregation, micro_batch_weights, nonfinite_message)
from grpokit.train.memory import trim_before_embedding_backward
from grpokit.rollout.weights_file import write_model_folder
from grpokit.train.weights import WeightStream, named_weights

__all__ = ["FUSED_LOSS_MIN_HEAD", "REFERENCE_FILE", "EntropyControl", "Learner", "NonFiniteError",
           "linear_aggregation", "loss_settings", "micro_batch_weights", "nonfinite_message", "training_mask"]

logger = logging.getLogger("grpokit")


def loss_settings(args: GRPOConfig) -> LossSettings:
    """The loss's numbers and names from the config (the KL leaves the loss when it is in the reward)."""
    objective, aggregation = args.resolved_loss
    return LossSettings(
        policy_objective=objective, loss_aggregation=aggregation,
        importance_sampling_level=args.importance_sampling_level, epsilon_low=args.epsilon_low,
        epsilon_high=args.resolved_epsilon_high, delta=args.delta, beta=0.0 if args.kl_in_reward else args.beta,
        kl_estimator=args.kl_estimator, use_bias_correction_kl=args.use_bias_correction_kl,
        off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_coef=args.entropy_coef,
        max_completion_length=args.max_completion_length, sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
        sampling_weights_per_sequence=IS_CORRECTION_MODES[args.vllm_importance_sampling_mode].per_sequence,
        extra=dict(args.loss_kwargs),
    )


class Learner(LearnerPasses, LearnerStep, LearnerState):
    """Policy, reference, optimizer and schedule; prepare (log-prob passes -> Experience) and step (the update).

    corrects_mismatch: the engine samples in another program, so the trainer's and the sampler's log-probs are
    compared (mismatch weights); reuses_batch: a batch outlives an optimizer step (old log-probs are needed);
    agentic: episodes use tools or environments."""

    def __init__(self, args: GRPOConfig, comm: Comm, model: Any, init_kwargs: dict[str, Any], peft_config,
                 optimizers: tuple, max_steps: int, reuses_batch: bool, corrects_mismatch: bool,
                 pad_token_id: int, rewards, agentic: bool = False) -> None:
        self.args, self.comm, self.pad_token_id, self.rewards = args, comm, pad_token_id, rewards
        self.reuses_batch, self.corrects_mismatch = reuses_batch, corrects_mismatch
        # before the model loads: its errors come first
        self.fsdp = run_options(args, comm.size, agentic, peft_config is not None or is_peft_model(model))
        optimizer, scheduler = optimizers if optimizers is not None else (None, None)
        if self.fsdp is not None and optimizer is not None:
            raise ConfigError("optimizers=(optimizer, ...) with FSDP: the optimizer must be built over the sharded "
                              "parameters, which exist only once the model is sharded; leave the optimizer to grpokit "
                              "(AdamW: learning_rate, adam_beta1/2, adam_epsilon, weight_decay).")
        checkpointing = args.gradient_checkpointing or (self.fsdp is not None and self.fsdp.activation_checkpointing)
        policy, self.ref_model = load_models(args, model, init_kwargs, peft_config, comm.device, checkpointing)
        self.uses_peft = is_peft_model(policy)
        self.vision_language = is_vision_language(getattr(causal_lm(policy), "config", None))
        self.settings = loss_settings(args)
        # the token budget in force: an explicit one, or the automatic one where regrouping is exact
        self.auto_budget = args.token_budget is None
        exact = not self.auto_budget or (regroupable(self.settings) and linear_aggregation(self.settings))
        self.token_budget = args.resolved_token_budget if exact else None
        if self.fsdp is not None:
            for module in (policy, self.ref_model):
                if module is not None:
                    shard(module.to(comm.device), self.fsdp, comm.device, args.bf16)
        if optimizer is None:
            trained = [p for p in policy.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(
                trained, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                weight_decay=args.weight_decay, fused=fused_adamw(trained, self.fsdp is not None),
            )
        if scheduler is None:
            warmup = args.warmup_steps or math.ceil(args.warmup_ratio * max_steps)
            try:  # config checks mirror get_scheduler's rules; this names the options if one slipped through
                scheduler = get_scheduler(args.lr_scheduler_type, optimizer, warmup, max_steps,
                                          scheduler_specific_kwargs=dict(args.lr_scheduler_kwargs))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"lr_scheduler_type={args.lr_scheduler_type!r} with lr_scheduler_kwargs="
                                  f"{args.lr_scheduler_kwargs}: {exc}") from exc
        self.scheduler = scheduler
        if self.fsdp is None:
            self.model, self.optimizer = comm.accelerator.prepare(policy, optimizer)
        else:
            self.model, self.optimizer = policy, optimizer
        self.in_place = in_place_gradients(self.model, comm.accelerator, self.fsdp is not None, comm.device)
        logger.debug("Gradients summed in place: %s", self.in_place.reason)
        self.version = 0  # bumped by every optimizer step that changed the weights, and by a resume

    @property
    def unwrapped(self) -> PreTrainedModel:
        return self.comm.accelerator.unwrap_model(self.model)

    def weights(self) -> WeightStream:
        """A fresh stream of the policy's weights for an engine (train/weights.py; under FSDP reading it is a
        collective)."""
        return named_weights(self.unwrapped)

    def export(self, folder: Path) -> None:
        """The policy as a Hugging Face model folder (config, generation config, model.safetensors) written from
        its weight stream: a PEFT adapter merged in, a sharded policy gathered a weight at a time (every process
        calls it; process 0 writes). A failed write is a SaveError naming the folder."""
        model = self.unwrapped
        base = model.get_base_model() if self.uses_peft else model
        with writing("Exporting the policy", folder, "Nothing else was changed; free space or pick another folder."):
            write_model_folder(self.weights(), base.config, getattr(base, "generation_config", None), Path(folder),
                               keep=self.comm.is_main)

    def lockstep(self) -> bool:
        """Generation calls must run as many policy forwards on every process: the policy is sharded and not
        gathered for generation, so each forward gathers its layers collectively."""
        return self.fsdp is not None and not is_gathered(self.model)

    def generating(self):
        """The context the local engine decodes in: under FSDP with ds3_gather_for_generation (TRL's default) the
        whole policy gathered once for the block; without it the block decodes in lockstep and frees the root after
        (`lockstep_decoding`); else nothing (vLLM has its own copy). Nested blocks do nothing: the collector
        gathers once around all the turns of multi-turn episodes, and each generation call inside reuses it
        (processes need not make the same number of calls)."""
        if self.fsdp is None or self.args.resolved_rollout_engine != "local":
            return contextlib.nullcontext()
        if not self.args.ds3_gather_for_generation:
            return lockstep_decoding(self.model)
        return gathered_for_generation(self.model, self.fsdp.reshard_after_forward)

    def autocast(self):
        if not self.args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.comm.device.type, dtype=torch.bfloat16)


def load_models(args: GRPOConfig, model, init_kwargs: dict[str, Any], peft_config, device, checkpointing: bool):
    """The policy (with its PEFT adapter, if any) and the reference model (only when beta != 0 and there is no
    adapter to switch off), dropout set as configured, gradient checkpointing on when `checkpointing`
    (gradient_checkpointing, or FSDP's activation_checkpointing)."""
    policy = load_policy(model, init_kwargs)
    vision_language = is_vision_language(getattr(policy, "config", None))
    if peft_config is not None:
        from peft import get_peft_model

        placed = place_adapter(peft_config, args.freeze_vision_tower) if vision_language else peft_config
        policy = get_peft_model(policy, placed)
    if vision_language and args.freeze_vision_tower:
        freeze_tower(policy)
    uses_peft = is_peft_model(policy)
    if args.sync_ref_model and uses_peft:
        raise ConfigError(
            "sync_ref_model=True with a PEFT adapter: the reference is the base model with the adapter switched "
            "off, so there is no separate reference to sync. Set sync_ref_model=False or train without PEFT."
        )
    ref_model = None
    if args.beta != 0.0 and not uses_peft:
        ref_model = reference_model(policy, model, init_kwargs).to(device)
    if args.disable_dropout:
        for module in [policy] + ([ref_model] if ref_model is not None else []):
            disable_dropout(module)
    if checkpointing:
        kwargs = args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if uses_peft:
            policy.enable_input_require_grads()
    policy.config.use_cache = False
    trim_before_embedding_backward(policy, torch.device(device))
    return policy, ref_model


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout probability to 0 (the modules and the config fields models read at forward time)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def fused_adamw(parameters: list[torch.Tensor], sharded: bool) -> bool | None:
    """AdamW's single-kernel implementation (transformers' default optimizer, `adamw_torch_fused`, which TRL
    trains with) for plain floating-point parameters on the CPU or CUDA: one pass over each tensor, with none of
    the per-tensor temporaries of the default loop (on the CPU a temporary the size of the largest parameter: the
    embedding). None (torch's choice) for sharded parameters and other devices."""
    devices = {p.device.type for p in parameters}
    plain = all(p.is_floating_point() and type(p) in (torch.Tensor, torch.nn.Parameter) for p in parameters)
    return True if parameters and not sharded and plain and devices <= {"cpu", "cuda"} else None

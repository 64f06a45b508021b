"""The learner: the models, the optimizer and every pass through them.

    experience, prepared = learner.prepare(batch)        # ScoredBatch -> Experience, built once
    stats = learner.step(experience, rows, entropy_coef)   # one optimizer step over micro-batches `rows`
    learner.version, learner.weights()                     # for the rollout engine

It holds the policy (its PEFT adapter, if any), the reference model (only when beta != 0 and there is no adapter
to switch off), AdamW and the schedule, wrapped by accelerate (DDP with several processes), or, with fsdp /
fsdp_config or an accelerate FSDP config file, both models sharded with FSDP2 (grpokit/train/fsdp.py): every
micro-batch then reduce-scatters its gradients (no no_sync: gradients stay sharded), the gradient norm is the global
norm over the shards, checkpoints hold every process's own shards (grpokit/train/distcp.py), and the final and best
models are saved from their full state dict gathered on process 0. The log-prob passes
pack samples without padding where that saves, run each distinct prompt once, and never build (b, T, V) logits
(grpokit/logprob_pass.py, grpokit/packing.py); token_budget regroups a step's samples into forwards of bounded
size with the loss unchanged, and token-separable losses run inside the head's chunks (docs/performance.md).
`version` counts the weights: every optimizer step that changed them, and a resume, bumps it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, load_model, save_model
from transformers import PreTrainedModel, get_scheduler

from grpokit.algorithms import (
    IS_CORRECTION_MODES,
    KL_ESTIMATORS,
    LossBatch,
    LossSettings,
    aggregation_weights,
    entropy_quantile_threshold,
    masked_mean,
    mismatch_weights,
    policy_loss,
    regroupable,
    token_losses,
    token_separable,
)
from grpokit.config import ConfigError, GRPOConfig
from grpokit import packing
from grpokit.logprob_pass import completion_logprobs, distinct_rows, output_head, varlen
from grpokit.modeling import is_peft_model, load_policy, load_weights, read_weights, reference_model
from grpokit.rollout.generate import left_pad
from grpokit.train.batches import Experience, Prepared, ScoredBatch, StepStats
from grpokit.train.comm import Comm
from grpokit.train.in_place import in_place_gradients
from grpokit.train.memory import embedding_rows_into_grad, release_free_memory, trim_before_embedding_backward
from grpokit.train.distcp import is_sharded_checkpoint, load_sharded, named_optimizer_state, save_sharded, saved_keys
from grpokit.train.fsdp import (clip_gradients, full_state_dict, gathered_for_generation, held_for_passes,
                                held_for_step, load_full_optimizer_state, load_full_state, reshard, run_options,
                                shard)

logger = logging.getLogger("grpokit")
FUSED_LOSS_MIN_HEAD = 1 << 21  # head parameters (V x H) from which the loss runs inside the head (fuses_loss)
REFERENCE_FILE = "reference.safetensors"  # the synced reference model's weights in a checkpoint (sync_ref_model)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stayed NaN/inf for max_consecutive_nonfinite_steps optimizer steps in a row."""


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


class Learner:
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

    def weights(self) -> torch.nn.Module:
        """The live policy an engine copies its weights from (sync_weights)."""
        return self.unwrapped

    def generating(self):
        """The context the local engine decodes in: under FSDP with ds3_gather_for_generation (TRL's default) the
        whole policy gathered once for the block; else nothing (FSDP gathers one layer per forward; vLLM has its own
        copy). Nested blocks do nothing: the collector gathers once around all the turns of multi-turn episodes, and
        each generation call inside reuses it (processes need not make the same number of calls)."""
        if self.fsdp is None or not self.args.ds3_gather_for_generation or self.args.resolved_rollout_engine != "local":
            return contextlib.nullcontext()
        return gathered_for_generation(self.model, self.fsdp.reshard_after_forward)

    def autocast(self):
        if not self.args.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.comm.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------ log-probs
    def logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=False,
                 entropy_grad=False, reshard_after=True, layout=None, token_loss=None, into_grad=False):
        """(b, T) log-probs of the completion tokens (and their entropies) from one forward pass. reshard_after
        (sharded, no grad): free the gathered weights after the pass (False: the caller holds them for more).
        layout: the packed rows (grpokit.packing) of a token-budgeted forward. into_grad (with token_loss): the
        head's dL/dW is summed straight into its weight's `.grad` (`head_token_loss`)."""
        device = self.comm.device
        # Padded path: each distinct prompt runs once, except where a second forward before backward would confuse
        # DDP's gradient hooks or gradient checkpointing (which turns the KV cache off), or would gather every
        # layer of a fully sharded model again (and twice more in the backward: the layers run twice). The packed
        # path shares prompts in its one forward in every mode.
        grad = torch.is_grad_enabled()
        ddp_with_grad = isinstance(model, torch.nn.parallel.DistributedDataParallel) and grad
        fully_sharded_with_grad = grad and self.fsdp is not None and self.fsdp.reshard_after_forward
        share = not ddp_with_grad and not fully_sharded_with_grad and not getattr(model, "is_gradient_checkpointing",
                                                                                   False)
        with self.autocast():
            result = completion_logprobs(
                model, prompt_ids.to(device), prompt_mask.to(device), completion_ids.to(device),
                completion_mask.to(device), self.args.temperature, with_entropy=entropy, share_prompts=share,
                entropy_grad=entropy_grad, pack=self.args.padding_free, layout=layout, token_loss=token_loss,
                into_grad=into_grad,
            )  # (b, T) each (token_loss: the loss first): position t is completion token t; no (b, T, V) logits
        if not grad and reshard_after:
            reshard(model)  # FSDP keeps the root gathered after a forward, for a backward this pass will not have
        return result

    def forwards(self, prompt_ids, prompt_mask, completion_mask, rows: torch.Tensor) -> list[packing.Forward]:
        """token_budget: the samples `rows` (indices) cut into packed forwards of at most token_budget tokens, as
        many on every process (sample numbers in the result index `rows`); the log-prob pass runs a forward padded
        where its rows would save too little (logprob_pass.PACK_WHEN). The automatic budget grows to a longer
        sample (prompts not truncated)."""
        # each distinct prompt once per row; with flash attention a prompt per sample: the budget counts every copy
        groups = list(range(len(rows))) if varlen(self.unwrapped) else \
            distinct_rows(prompt_ids[rows], prompt_mask[rows])[1].tolist()
        prompts, completions = packing.lengths(prompt_mask[rows], completion_mask[rows])
        budget = self.token_budget
        if self.auto_budget:
            budget = max(budget, int((prompts + completions).max()) if len(rows) else 0)
        try:
            planned = packing.budget_forwards(groups, prompts.tolist(), completions.tolist(), budget,
                                              packing.row_tokens(self.unwrapped.config))
        except ValueError as exc:
            raise ConfigError(f"{exc} (prompt + completion; a sample is never split): raise token_budget to at "
                              "least max_prompt_length + max_completion_length.") from exc
        count = max(self.comm.gather(len(planned))) if self.comm.size > 1 else len(planned)
        return packing.equalize(planned, count)

    @staticmethod
    def _subset(prompt_ids, prompt_mask, completion_ids, completion_mask, index: torch.Tensor):
        """The rows `index`, trimmed to their own widest prompt and completion."""
        prompt_width = int(prompt_mask[index].sum(-1).max())
        width = int(completion_mask[index].sum(-1).max().clamp(min=1))
        return (prompt_ids[index, -prompt_width:], prompt_mask[index, -prompt_width:], completion_ids[index, :width],
                completion_mask[index, :width])

    @torch.no_grad()
    def batched_logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        """No-grad log-probs of a whole local batch, in micro-batch-sized chunks (token_budget: token-budgeted
        packed forwards): (n, T) on CPU. Sharded, the weights are gathered once for all the chunks: the whole
        model with ds3_gather_for_generation (it is gathered whole for generation already), else the root once
        and each layer per forward."""
        size, n = self.args.per_device_train_batch_size, completion_ids.shape[0]
        tensors = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        held = self.fsdp is not None and self.args.ds3_gather_for_generation
        out = torch.zeros(completion_ids.shape, dtype=torch.float32)
        with held_for_passes(model, held, self.fsdp is not None and self.fsdp.reshard_after_forward):
            if self.token_budget is None:
                parts = [(torch.arange(start, min(start + size, n)), None) for start in range(0, n, size)]
            else:
                everything = torch.arange(n)
                parts = [(torch.tensor(f.samples, dtype=torch.long), f.layout)
                         for f in self.forwards(prompt_ids, prompt_mask, completion_mask, everything)]
            for index, layout in parts:
                logp, _ = self.logprobs(model, *self._subset(*tensors, index), reshard_after=False, layout=layout)
                out[index, : logp.shape[1]] = logp.float().cpu()
        return out
    def reference_logprobs(self, *tensors: torch.Tensor, chunked: bool = True) -> torch.Tensor | None:
        """log pi_ref of a local batch when beta != 0 (PEFT: the policy with its adapter switched off), in
        micro-batch-sized chunks on the CPU, or (chunked=False) in one pass on the device."""
        def run(model):
            return self.batched_logprobs(model, *tensors) if chunked else self.logprobs(model, *tensors)[0]

        if self.ref_model is not None:
            return run(self.ref_model)
        if self.args.beta == 0.0:
            return None
        with self.unwrapped.disable_adapter():
            return run(self.model)

    # ------------------------------------------------------------------ batch -> experience
    def prepare(self, batch: ScoredBatch, advantages=None) -> tuple[Experience, Prepared]:
        """The update's view of a batch: padded tensors, the loss mask, old log-probs (when the batch is reused,
        or was sampled by older weights, or the KL goes into the reward), mismatch weights against the sampler's
        log-probs, reference log-probs, and this process's advantages. `advantages`: a callable (rewards, steps,
        weights) -> (advantages, stats) for kl_in_reward, which adds a reward column -beta x the summed KL."""
        args, rollout = self.args, batch.rollout
        prompt_ids, prompt_mask = left_pad(batch.prompt_ids, self.pad_token_id)
        tensors = (prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        loss_mask = training_mask(rollout, args.mask_truncated_completions)
        reused = self.reuses_batch or batch.weights_version != self.version
        old_logp = sampling_weights = None
        mismatch: dict[str, torch.Tensor] = {}
        if reused or self.corrects_mismatch or args.kl_in_reward:
            trainer_logp = self.batched_logprobs(self.model, *tensors)
            old_logp = trainer_logp if reused else None  # fresh batch: pi_old = pi_theta
            if self.corrects_mismatch:
                sampling_weights, mismatch = mismatch_weights(
                    trainer_logp, rollout.logprobs, rollout.model_mask.float(), args.vllm_importance_sampling_mode,
                    args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
                )
        sampling_logp = rollout.logprobs if args.off_policy_mask_threshold is not None else None
        ref_logp = self.reference_logprobs(*tensors)
        all_advantages, prepared = batch.advantages, Prepared(mismatch)
        if args.kl_in_reward:
            rewards, weights, names = self.with_kl_penalty(batch, trainer_logp, ref_logp, loss_mask)
            all_advantages, stats = advantages(rewards, batch.steps, weights)
            prepared = Prepared(mismatch, stats, names)
        mine = all_advantages[batch.local]
        if mine.dim() == 2:
            mine = mine[:, : rollout.completion_ids.shape[1]].contiguous()
        experience = Experience(prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask, loss_mask,
                                mine, old_logp, ref_logp, sampling_weights, sampling_logp)
        release_free_memory()  # the passes' activations, and generation's, back to the system (memory.py)
        return experience, prepared

    def with_kl_penalty(self, batch: ScoredBatch, trainer_logp, ref_logp, loss_mask):
        """rewards (N, F) -> (N, F + 1): a column -beta * sum_t k(log pi_old, log pi_ref) over counted tokens, NaN
        where no reward function scored the completion (so it stays unscored); the weights and names to match."""
        kl = KL_ESTIMATORS[self.args.kl_estimator](trainer_logp, ref_logp)  # (n, T)
        local = (kl * loss_mask).sum(-1)  # (n,)
        rewards = batch.rewards
        penalty = -self.args.beta * torch.cat(self.comm.gather(local)).to(rewards.dtype)  # (N,)
        scored = ~torch.isnan(rewards).all(-1)
        penalty = torch.where(scored, penalty, torch.full_like(penalty, float("nan")))
        weights = torch.cat([self.rewards.weights, torch.ones(1)])
        names = self.rewards.names + ["kl_penalty"]
        return torch.cat([rewards, penalty.unsqueeze(-1)], -1), weights, names

    # ------------------------------------------------------------------ the update
    def step(self, exp: Experience, batches: list[slice], entropy_coef: float) -> StepStats:
        """One optimizer step over the micro-batches `batches` of `exp` (no DDP sync until the last): clip the
        gradient norm, then AdamW and the schedule unless the loss or the norm is not finite on some process
        (then the gradients are dropped and nothing advances)."""
        comm = self.comm
        local_tokens = sum(exp.loss_mask[rows].sum() for rows in batches).float()
        token_normalizer = comm.sum(local_tokens) / comm.size
        # no counted token anywhere (every completion truncated and masked): a zero loss, not 0/0
        token_normalizer = torch.where(token_normalizer > 0, token_normalizer, torch.ones_like(token_normalizer))
        token_sums: dict[str, torch.Tensor] = {}  # token-weighted, so splits across processes don't matter
        step_loss, step_bonus = torch.zeros((), device=comm.device), None  # bonus: the entropy bonus's part
        settings = dataclasses.replace(self.settings, entropy_coef=entropy_coef)
        entropy_stats = torch.zeros(2, device=comm.device)  # (entropy sum, tokens) over the policy term's tokens
        # FSDP: every micro-batch reduce-scatters its gradients (no no_sync: they stay sharded); the root (all units
        # with shard_grad_op) is gathered once for the step's micro-batches and freed after the last
        held = contextlib.nullcontext() if self.fsdp is None else held_for_step(self.model,
                                                                                self.fsdp.reshard_after_forward)
        with held:
            plan = self.step_plan(exp, batches, token_normalizer, settings)
            in_place = self.in_place.enabled
            for index, (rows, weights, layout, scale) in enumerate(plan):
                sync = index == len(plan) - 1 or self.fsdp is not None
                rows_into_grad = embedding_rows_into_grad(self.unwrapped) if in_place else contextlib.nullcontext()
                with contextlib.nullcontext() if sync else comm.accelerator.no_sync(self.model), rows_into_grad:
                    loss, metrics, stats = self.micro_batch_loss(exp, rows, len(batches), token_normalizer, settings,
                                                                 weights, layout, into_grad=in_place and scale == 1.0)
                    comm.accelerator.backward(loss * scale if scale != 1.0 else loss)
                if scale == 0.0:  # a filler forward (token_budget): it keeps the processes in step, counts nothing
                    continue
                entropy_stats += stats
                step_loss += loss.detach().float()
                if "entropy_bonus" in metrics:
                    bonus = metrics.pop("entropy_bonus").float()
                    step_bonus = bonus if step_bonus is None else step_bonus + bonus
                tokens = exp.loss_mask[rows].sum().to(comm.device).float()
                for key, value in {**metrics, "tokens": torch.ones((), device=comm.device)}.items():
                    token_sums[key] = token_sums.get(key, 0.0) + value.detach().float() * tokens
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        if self.fsdp is None:
            grad_norm = comm.accelerator.clip_grad_norm_(self.model.parameters(), max_norm)
        else:
            grad_norm = clip_gradients(self.model.parameters(), max_norm)
        bad = ~torch.isfinite(step_loss) | ~torch.isfinite(torch.as_tensor(grad_norm))
        # one sum gives every process the same decision and, for adaptive control, the step's entropy
        flags = comm.sum(torch.cat([bad.float().reshape(1).to(comm.device), entropy_stats]))
        skipped, entropy = bool(flags[0].item() > 0), None
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
            self.version += 1
            if self.args.use_adaptive_entropy:
                entropy = (flags[1] / flags[2].clamp(min=1.0)).item()
        self.optimizer.zero_grad(set_to_none=True)
        release_free_memory()
        return StepStats(step_loss, step_bonus, token_sums, float(grad_norm), skipped, entropy)

    def step_plan(self, exp: Experience, batches: list[slice], token_normalizer, settings) -> list[tuple]:
        """The step's forwards: (rows, (token weights, bonus weights) or None, packed layout or None, loss scale).
        Without token_budget, one forward per micro-batch (its aggregation computed in the loss). With it, the
        step's samples regrouped into token-budgeted forwards, each token carrying its micro-batch's aggregation
        as a coefficient (losses.aggregation_weights), so the loss and gradients do not depend on the grouping."""
        unbudgeted = [(rows, None, None, 1.0) for rows in batches]
        if self.token_budget is None:
            return unbudgeted
        width = exp.completion_mask.shape[1]
        step_rows = torch.cat([torch.arange(rows.start, rows.stop) for rows in batches])
        weights = torch.zeros(len(step_rows), width)
        bonus = torch.zeros(len(step_rows), width)
        at = 0
        for rows in batches:
            try:
                token, entropy = micro_batch_weights(exp, rows, len(batches), token_normalizer, settings)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
            weights[at : at + len(token)], bonus[at : at + len(token)] = token, entropy
            at += len(token)
        plan = []
        for forward in self.forwards(exp.prompt_ids, exp.prompt_mask, exp.completion_mask, step_rows):
            local = torch.tensor(forward.samples, dtype=torch.long)
            plan.append((step_rows[local], (weights[local], bonus[local]), forward.layout, forward.weight))
        return plan

    def micro_batch_loss(self, exp: Experience, rows, num_micro_batches: int, token_normalizer, settings,
                         weights=None, layout=None, into_grad=False):
        """Loss, metrics and (entropy sum, token count) over the policy term's tokens, for one forward: a
        micro-batch (`rows` a slice), or a token-budgeted group of samples (`rows` indices, `weights` their
        aggregation and bonus coefficients, `layout` their packed rows). into_grad: the loss is backpropagated
        as it is and the fused head may sum dL/dW into its weight's gradient (`train.in_place`)."""
        index = rows if isinstance(rows, torch.Tensor) else torch.arange(rows.start, rows.stop)
        prompt_ids, prompt_mask, completion_ids, completion_mask = self._subset(
            exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask, index)
        width = completion_ids.shape[1]
        device = self.comm.device
        loss_mask = exp.loss_mask[rows, :width].to(device)

        def part(t):
            return None if t is None else t[rows, :width].to(device)

        advantages = exp.advantages[rows]
        advantages = (advantages[:, :width] if advantages.dim() == 2 else advantages).to(device)
        constants = dict(old_logp=part(exp.old_logp), ref_logp=part(exp.ref_logp),
                         sampling_logp=part(exp.sampling_logp), sampling_weights=part(exp.sampling_weights))
        fuses = self.fuses_loss(settings)
        if weights is None and fuses:
            try:
                weights = micro_batch_weights(exp, rows, num_micro_batches, token_normalizer, settings)
            except ValueError:  # a user aggregation that is not linear: the loss after the head, below
                pass
        fused = weights is not None and fuses
        token_weights = None if weights is None else weights[0][:, :width].to(device)
        bonus_weights = None if weights is None else weights[1][:, :width].to(device)
        if fused:  # the loss inside the head's chunks: its gradients in the forward (3 head matmuls, not 4)
            token_loss = self._token_loss(advantages, loss_mask, constants, token_weights, bonus_weights, settings)
            fused_loss, logp, entropy = self.logprobs(self.model, prompt_ids, prompt_mask, completion_ids,
                                                      completion_mask, entropy=True, layout=layout,
                                                      entropy_grad=settings.entropy_coef != 0.0,
                                                      token_loss=token_loss, into_grad=into_grad)
        else:
            logp, entropy = self.logprobs(self.model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                          entropy=True, entropy_grad=settings.entropy_coef != 0.0, layout=layout)
        threshold = None
        if self.args.top_entropy_quantile < 1.0:
            counted = self.comm.concat(entropy.detach()[loss_mask.bool()].float())
            threshold = entropy_quantile_threshold(counted, self.args.top_entropy_quantile).to(entropy.device)
        batch = LossBatch(
            logp, advantages, loss_mask, **constants, entropy=entropy, entropy_threshold=threshold,
            num_micro_batches=num_micro_batches, token_normalizer=token_normalizer, token_weights=token_weights,
            bonus_weights=bonus_weights,
        )
        loss, metrics = policy_loss(batch, settings)  # fused: the same loss, from detached log-probs (metrics)
        if fused:
            loss = fused_loss
        metrics["entropy"] = masked_mean(entropy.detach(), loss_mask)
        policy_tokens = loss_mask if threshold is None else loss_mask * (entropy.detach() >= threshold)
        stats = torch.stack([(entropy.detach() * policy_tokens).sum(), policy_tokens.sum()]).float()
        return loss, metrics, stats

    def fuses_loss(self, settings: LossSettings) -> bool:
        """The training loss runs inside the head's chunks (`algorithms.head_token_loss`): a token-separable loss,
        the whole-batch entropy quantile off, a plain linear head, and a head large enough for its fourth product
        to matter (FUSED_LOSS_MIN_HEAD parameters; below that the bookkeeping costs more than it saves)."""
        head = output_head(self.model)
        return (token_separable(settings) and self.args.top_entropy_quantile == 1.0 and type(head) is torch.nn.Linear
                and head.weight.numel() >= FUSED_LOSS_MIN_HEAD)

    @staticmethod
    def _token_loss(advantages, mask, constants, token_weights, bonus_weights, settings):
        """token_loss(logp, entropy, rows, cols) for `completion_logprobs`: the micro-batch's loss restricted to
        the tokens (rows, cols), sum_t c_t L_t - entropy_coef sum_t e_t H_t (one (1, n) row of per-token terms)."""
        def token_loss(logp, entropy, rows, cols):
            pick = (lambda t: None if t is None else t[rows, cols].unsqueeze(0))  # noqa: E731
            adv = advantages[rows, cols] if advantages.dim() == 2 else advantages[rows]
            picked = {k: pick(v) for k, v in constants.items()}
            row = LossBatch(logp.unsqueeze(0), adv.unsqueeze(0), pick(mask), **picked,
                            entropy=None if entropy is None else entropy.unsqueeze(0))
            per_token = token_losses(row, settings)[0]
            loss = (per_token * pick(token_weights).to(per_token.dtype)).sum()
            if settings.entropy_coef != 0.0:
                loss = loss - settings.entropy_coef * (entropy * bonus_weights[rows, cols].to(entropy.dtype)).sum()
            return loss

        return token_loss

    @torch.no_grad()
    def evaluation_loss(self, exp: Experience) -> float:
        """The training loss on completions the policy just sampled (every ratio 1), one batch at once."""
        logp, entropy = self.logprobs(self.model, exp.prompt_ids, exp.prompt_mask, exp.completion_ids,
                                      exp.completion_mask, entropy=self.settings.entropy_coef != 0.0)
        device = self.comm.device
        batch = LossBatch(logp, exp.advantages.to(device), exp.loss_mask.to(device),
                          ref_logp=None if exp.ref_logp is None else exp.ref_logp.to(device), entropy=entropy)
        return policy_loss(batch, self.settings)[0].item()

    def evaluation_experience(self, prompt_ids: list[list[int]], rollout, advantages) -> Experience:
        """An eval chunk as the loss reads it: on-policy, reference log-probs when beta != 0, no sampler terms."""
        prompt_ids, prompt_mask = left_pad(prompt_ids, self.pad_token_id)
        tensors = (prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        with torch.no_grad():
            ref_logp = self.reference_logprobs(*tensors, chunked=False)
        return Experience(*tensors, training_mask(rollout, self.args.mask_truncated_completions), advantages,
                          ref_logp=ref_logp)

    @torch.no_grad()
    def sync_reference(self) -> None:
        """TR-DPO: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, parameter by parameter."""
        alpha = self.args.ref_model_mixup_alpha
        policy = dict(self.unwrapped.named_parameters())
        for name, ref_param in self.ref_model.named_parameters():
            ref_param.mul_(1.0 - alpha).add_(policy[name].detach().to(ref_param.dtype), alpha=alpha)

    # ------------------------------------------------------------------ checkpoints
    @contextlib.contextmanager
    def gathered(self):
        """Every process enters it around write_model: under FSDP the whole model is gathered onto process 0's CPU
        for the block (a collective), and freed after; nothing otherwise."""
        self._full_state = full_state_dict(self.model) if self.fsdp is not None else None
        try:
            yield
        finally:
            self._full_state = None

    def write_model(self, folder: Path, tokenizer) -> None:
        """The model (HF format, from the gathered state under FSDP: inside `gathered`) and the tokenizer."""
        state = getattr(self, "_full_state", None)
        if self.fsdp is not None and state is None:
            raise RuntimeError("write_model of a sharded model runs inside learner.gathered(), on every process.")
        self.unwrapped.save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)

    def load_weights(self, folder: Path) -> None:
        """The weights saved in `folder` (save_pretrained's files) into the policy; every process calls it."""
        if self.fsdp is None:
            load_weights(self.unwrapped, folder)
            return
        if self.uses_peft:
            raise ConfigError("Loading saved adapter weights into a sharded PEFT model is not supported yet; resume "
                              "or load the best model without fsdp.")
        load_full_state(self.model, read_weights(folder) if self.comm.is_main else {})

    def save(self, folder: Path, tokenizer) -> None:
        """The weights, tokenizer, optimizer, schedule and a synced reference. Without FSDP process 0 writes them
        whole (HF format, optimizer.pt); under FSDP every process writes its own shards (distcp.SHARDED_DIR) and
        process 0 the model's config, the tokenizer and the schedule."""
        if self.fsdp is not None:
            reference = self.ref_model if self.args.sync_ref_model else None
            save_sharded(folder, self.model, self.optimizer, reference, adapter_only=self.uses_peft)
            if self.comm.is_main:
                self.write_model_files(folder, tokenizer)
                torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
            return
        if not self.comm.is_main:
            return
        self.write_model(folder, tokenizer)
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
        if self.args.sync_ref_model:  # the synced reference has moved away from the starting weights
            save_model(self.ref_model, str(folder / REFERENCE_FILE))

    def write_model_files(self, folder: Path, tokenizer) -> None:
        """What a sharded checkpoint needs beside its shards to become a Hugging Face folder (grpo export): the
        model's config and generation config (an adapter's config too), and the tokenizer."""
        model = self.unwrapped
        base = model.get_base_model() if self.uses_peft else model
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
        if self.uses_peft:
            model.peft_config["default"].save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    def load(self, folder: Path, saved_processes: int | None = None) -> None:
        """A checkpoint's weights, optimizer, schedule and synced reference, written sharded (any number of
        processes: re-sharded to this run's) or whole (DDP or one process: loaded whole, or into the shards)."""
        reference = self.ref_model if self.args.sync_ref_model else None
        if is_sharded_checkpoint(folder):
            if reference is not None and not any(k.startswith("reference.") for k in saved_keys(folder)):
                reference = None  # written before sync_ref_model was set: the reference starts from the model
            model = self.model if self.fsdp is not None else self.unwrapped
            load_sharded(folder, model, self.optimizer, reference, adapter_only=self.uses_peft)
            if saved_processes not in (None, self.comm.size):
                logger.warning("Re-sharded %s from %d processes to %d: each process read its part of every "
                               "weight and optimizer moment.", folder, saved_processes, self.comm.size)
        else:
            self._load_whole(folder, reference)
        self.version += 1  # the engine must be given the checkpoint's weights
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))

    def _load_whole(self, folder: Path, reference) -> None:
        """A checkpoint written whole (HF weights, optimizer.pt numbered by parameter, reference.safetensors)."""
        self.load_weights(folder)
        optimizer = torch.load(folder / "optimizer.pt", weights_only=False)
        if self.fsdp is None:
            self.optimizer.load_state_dict(optimizer)
        else:
            whole = named_optimizer_state(self.model, optimizer) if self.comm.is_main else {}
            load_full_optimizer_state(self.model, self.optimizer, whole)
        if reference is not None and (folder / REFERENCE_FILE).is_file():
            if self.fsdp is None:
                device = str(next(reference.parameters()).device)  # "cpu", never accelerate's "cpu:0"
                load_model(reference, str(folder / REFERENCE_FILE), device=device)
            else:
                load_full_state(reference, load_file(folder / REFERENCE_FILE) if self.comm.is_main else {})


def linear_aggregation(settings: LossSettings) -> bool:
    """Whether the configured loss aggregation is linear in the per-token losses (`losses.aggregation_weights`'
    check, on a small probe batch): what the automatic token budget needs."""
    mask = (torch.arange(15).reshape(3, 5) % 4 != 3).float()
    probe = LossBatch(mask, torch.ones(3), mask, num_micro_batches=1, token_normalizer=mask.sum().double())
    try:
        aggregation_weights(mask, probe, settings)
    except ValueError:
        return False
    return True


def micro_batch_weights(exp: Experience, rows: slice, num_micro_batches: int, token_normalizer, settings):
    """(b, T) aggregation and entropy-bonus coefficients of the micro-batch `rows` (losses.aggregation_weights):
    its loss is sum_t c_t L_t - entropy_coef sum_t e_t H_t, however its tokens are grouped into forwards."""
    mask = exp.loss_mask[rows].float()
    logical = LossBatch(mask, exp.advantages[rows], mask, num_micro_batches=num_micro_batches,
                        token_normalizer=token_normalizer.detach().cpu().double())
    return aggregation_weights(mask, logical, settings), mask / mask.sum().clamp(min=1.0) / num_micro_batches


def training_mask(rollout, mask_truncated: bool) -> torch.Tensor:
    """(n, T) the tokens the loss counts: the model's own (tool / environment tokens are context, never in the
    loss), none of a truncated completion's with mask_truncated_completions."""
    mask = rollout.model_mask.clone()
    if mask_truncated:
        mask[rollout.truncated] = 0
    return mask


def load_models(args: GRPOConfig, model, init_kwargs: dict[str, Any], peft_config, device, checkpointing: bool):
    """The policy (with its PEFT adapter, if any) and the reference model (only when beta != 0 and there is no
    adapter to switch off), dropout set as configured, gradient checkpointing on when `checkpointing`
    (gradient_checkpointing, or FSDP's activation_checkpointing)."""
    policy = load_policy(model, init_kwargs)
    if peft_config is not None:
        from peft import get_peft_model

        policy = get_peft_model(policy, peft_config)
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


@dataclasses.dataclass(frozen=True)
class EntropyControl:
    """Adaptive entropy control (Skywork-OR1): after each step the coefficient moves by +delta when the step's
    entropy was at or below `target`, by -delta above it, kept within [low, high]; the bonus applies only while
    the last step's entropy is at or below the target. Off (`adaptive` False): the coefficient is constant."""

    adaptive: bool
    target: float
    delta: float
    low: float
    high: float

    @classmethod
    def from_args(cls, args: GRPOConfig) -> "EntropyControl":
        return cls(args.use_adaptive_entropy, args.entropy_target, args.entropy_coef_delta, args.entropy_coef_min,
                   args.entropy_coef_max)

    def applied(self, coef: float, last_entropy: float) -> float:
        """The entropy bonus's coefficient for the next step."""
        return 0.0 if self.adaptive and last_entropy > self.target else coef

    def next(self, coef: float, entropy: float) -> float:
        """The coefficient after a step whose policy tokens had mean entropy `entropy`."""
        step = self.delta if entropy <= self.target else -self.delta
        return min(max(coef + step, self.low), self.high)


def nonfinite_message(count: int, step: int, stats: StepStats) -> str:
    return (f"The loss or gradient norm was NaN/inf in {count} optimizer steps in a row (up to step {step}: "
            f"loss={stats.loss.item()}, grad_norm={stats.grad_norm}), so training stopped. Lower learning_rate, "
            "keep max_grad_norm > 0, try bf16=False, check the model loads without NaN weights, or resume from an "
            "earlier checkpoint; max_consecutive_nonfinite_steps sets how many skipped steps in a row are tolerated.")

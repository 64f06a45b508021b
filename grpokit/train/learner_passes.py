"""The learner's passes: batches become the update's `Experience` through log-prob passes of the policy and the
reference (grpokit/passes/), in micro-batch-sized chunks or token-budgeted packed forwards.

    experience, prepared = learner.prepare(batch)        # ScoredBatch -> Experience, built once
"""

from __future__ import annotations

import dataclasses

import torch

from grpokit.algorithms import KL_ESTIMATORS, mismatch_weights
from grpokit.config import ConfigError
from grpokit.passes import PassRequest, PassResult, Tokens, distinct_rows, packing, run_pass, varlen
from grpokit.passes.forward import vision_ids
from grpokit.rollout.generate import left_pad
from grpokit.train.batches import Experience, Prepared, ScoredBatch
from grpokit.train.fsdp import held_for_passes, reshard
from grpokit.train.memory import release_free_memory


class LearnerPasses:
    """The Learner's log-prob passes and `prepare` (its models, options and comm are the Learner's)."""

    def run_pass(self, model, tokens: Tokens, request: PassRequest = PassRequest(),
                 reshard_after: bool = True) -> PassResult:
        """One log-prob pass of `model` over `tokens` (grpokit.passes), with the run's temperature, packing and
        prompt sharing filled into `request`. reshard_after (sharded, no grad): free the gathered weights after the
        pass (False: the caller holds them for more)."""
        # Padded path: each distinct prompt runs once, except where a second forward before backward would confuse
        # DDP's gradient hooks or gradient checkpointing (which turns the KV cache off), or would gather every
        # layer of a fully sharded model again (and twice more in the backward: the layers run twice). The packed
        # path shares prompts in its one forward in every mode.
        grad = torch.is_grad_enabled()
        ddp_with_grad = isinstance(model, torch.nn.parallel.DistributedDataParallel) and grad
        fully_sharded_with_grad = grad and self.fsdp is not None and self.fsdp.reshard_after_forward
        share = not ddp_with_grad and not fully_sharded_with_grad and not getattr(model, "is_gradient_checkpointing",
                                                                                   False)
        request = dataclasses.replace(request, temperature=self.args.temperature, share_prompts=share,
                                      share_images=self.fsdp is None, pack=self.args.padding_free)
        with self.autocast():
            result = run_pass(model, tokens.to(self.comm.device), request)  # no (b, T, V) logits
        if not grad and reshard_after:
            reshard(model)  # FSDP keeps the root gathered after a forward, for a backward this pass will not have
        return result

    def logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask, entropy: bool = False):
        """(b, T) log-probs of the completion tokens and their entropies (None unless `entropy`): `run_pass` for
        callers with the four tensors at hand (as `passes.completion_logprobs`)."""
        result = self.run_pass(model, Tokens(prompt_ids, prompt_mask, completion_ids, completion_mask),
                               PassRequest(entropy=entropy))
        return result.logprobs, result.entropies

    def forwards(self, prompt_ids, prompt_mask, completion_mask, rows: torch.Tensor,
                 vision: tuple | None = None) -> list[packing.Forward]:
        """token_budget: the samples `rows` (indices) cut into packed forwards of at most token_budget tokens, as
        many on every process (sample numbers in the result index `rows`); the log-prob pass runs a forward padded
        where its rows would save too little (passes.PACK_WHEN). The automatic budget grows to a longer
        sample (prompts not truncated). vision: each row's prompt images (two prompts with equal ids but other
        images are two prompts)."""
        # each distinct prompt once per row; with flash attention a prompt per sample: the budget counts every copy
        groups = list(range(len(rows))) if varlen(self.unwrapped) else \
            distinct_rows(prompt_ids[rows], prompt_mask[rows], vision_ids(rows_of(vision, rows)))[1].tolist()
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
    def batched_logprobs(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                         vision: tuple | None = None) -> torch.Tensor:
        """No-grad log-probs of a whole local batch, in micro-batch-sized chunks (token_budget: token-budgeted
        packed forwards): (n, T) on CPU; vision: each row's prompt images, or None. Sharded, the weights are gathered once for all the chunks: the whole
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
                         for f in self.forwards(prompt_ids, prompt_mask, completion_mask, everything, vision)]
            for index, layout in parts:
                tokens = Tokens(*self._subset(*tensors, index), rows_of(vision, index))
                logp = self.run_pass(model, tokens, PassRequest(layout=layout), reshard_after=False).logprobs
                out[index, : logp.shape[1]] = logp.float().cpu()
        return out

    def reference_logprobs(self, *tensors: torch.Tensor, chunked: bool = True,
                           vision: tuple | None = None) -> torch.Tensor | None:
        """log pi_ref of a local batch when beta != 0 (PEFT: the policy with its adapter switched off), in
        micro-batch-sized chunks on the CPU, or (chunked=False) in one pass on the device."""
        def run(model):
            if chunked:
                return self.batched_logprobs(model, *tensors, vision=vision)
            return self.run_pass(model, Tokens(*tensors, vision)).logprobs

        if self.ref_model is not None:
            return run(self.ref_model)
        if self.args.beta == 0.0:
            return None
        with self.unwrapped.disable_adapter():
            return run(self.model)

    def prepare(self, batch: ScoredBatch, advantages=None) -> tuple[Experience, Prepared]:
        """The update's view of a batch: padded tensors, the loss mask, old log-probs (when the batch is reused,
        or was sampled by older weights, or the KL goes into the reward), mismatch weights against the sampler's
        log-probs, reference log-probs, and this process's advantages. `advantages`: a callable (rewards, steps,
        weights) -> (advantages, stats) for kl_in_reward, which adds a reward column -beta x the summed KL."""
        args, rollout = self.args, batch.rollout
        vision = None if batch.vision is None else tuple(batch.vision)
        prompt_ids, prompt_mask = left_pad(batch.prompt_ids, self.pad_token_id)
        tensors = (prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        loss_mask = training_mask(rollout, args.mask_truncated_completions)
        reused = self.reuses_batch or batch.weights_version != self.version
        old_logp = sampling_weights = None
        mismatch: dict[str, torch.Tensor] = {}
        if reused or self.corrects_mismatch or args.kl_in_reward:
            trainer_logp = self.batched_logprobs(self.model, *tensors, vision=vision)
            old_logp = trainer_logp if reused else None  # fresh batch: pi_old = pi_theta
            if self.corrects_mismatch:
                sampling_weights, mismatch = mismatch_weights(
                    trainer_logp, rollout.logprobs, rollout.model_mask.float(), args.vllm_importance_sampling_mode,
                    args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max,
                )
        sampling_logp = rollout.logprobs if args.off_policy_mask_threshold is not None else None
        ref_logp = self.reference_logprobs(*tensors, vision=vision)
        all_advantages, prepared = batch.advantages, Prepared(mismatch)
        if args.kl_in_reward:
            rewards, weights, names = self.with_kl_penalty(batch, trainer_logp, ref_logp, loss_mask)
            all_advantages, stats = advantages(rewards, batch.steps, weights)
            prepared = Prepared(mismatch, stats, names)
        mine = all_advantages[batch.local]
        if mine.dim() == 2:
            mine = mine[:, : rollout.completion_ids.shape[1]].contiguous()
        experience = Experience(prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask, loss_mask,
                                mine, old_logp, ref_logp, sampling_weights, sampling_logp, vision)
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

    def evaluation_experience(self, prompt_ids: list[list[int]], rollout, advantages,
                              vision: list | None = None) -> Experience:
        """An eval chunk as the loss reads it: on-policy, reference log-probs when beta != 0, no sampler terms."""
        prompt_ids, prompt_mask = left_pad(prompt_ids, self.pad_token_id)
        tensors = (prompt_ids, prompt_mask, rollout.completion_ids, rollout.completion_mask)
        vision = None if vision is None else tuple(vision)
        with torch.no_grad():
            ref_logp = self.reference_logprobs(*tensors, chunked=False, vision=vision)
        return Experience(*tensors, training_mask(rollout, self.args.mask_truncated_completions), advantages,
                          ref_logp=ref_logp, vision=vision)


def rows_of(vision: tuple | None, index: torch.Tensor) -> tuple | None:
    """The rows `index` of a per-row vision tuple (None stays None)."""
    return None if vision is None else tuple(vision[i] for i in index.tolist())


def training_mask(rollout, mask_truncated: bool) -> torch.Tensor:
    """(n, T) the tokens the loss counts: the model's own (tool / environment tokens are context, never in the
    loss), none of a truncated completion's with mask_truncated_completions."""
    mask = rollout.model_mask.clone()
    if mask_truncated:
        mask[rollout.truncated] = 0
    return mask

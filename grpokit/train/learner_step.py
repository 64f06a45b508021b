"""The learner's update: one optimizer step over a batch's micro-batches (or token-budgeted forwards), its loss
inside the head's chunks where that is exact, gradient clipping, and the skip of a non-finite step.

    stats = learner.step(experience, rows, entropy_coef)   # one optimizer step over micro-batches `rows`
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from grpokit.algorithms import (LossBatch, LossSettings, aggregation_weights, entropy_quantile_threshold,
                                masked_mean, policy_loss, token_losses, token_separable)
from grpokit.config import ConfigError, GRPOConfig
from grpokit.passes import PassRequest, Tokens, output_head
from grpokit.train.batches import Experience, StepStats
from grpokit.train.fsdp import clip_gradients, held_for_step
from grpokit.train.learner_passes import rows_of
from grpokit.train.memory import embedding_rows_into_grad, release_free_memory

FUSED_LOSS_MIN_HEAD = 1 << 21  # head parameters (V x H) from which the loss runs inside the head (fuses_loss)


class NonFiniteError(RuntimeError):
    """The loss or gradient norm stayed NaN/inf for max_consecutive_nonfinite_steps optimizer steps in a row."""


class LearnerStep:
    """The Learner's optimizer step (its models, optimizer, options and comm are the Learner's)."""

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
                    scaled = loss * scale if scale != 1.0 else loss
                    comm.accelerator.backward(scaled + every_parameter(self.model) if self.touches_every_parameter
                                              else scaled)
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
        for forward in self.forwards(exp.prompt_ids, exp.prompt_mask, exp.completion_mask, step_rows, exp.vision):
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
        request = PassRequest(entropy=True, entropy_grad=settings.entropy_coef != 0.0, layout=layout)
        if fused:  # the loss inside the head's chunks: its gradients in the forward (3 head matmuls, not 4)
            token_loss = self._token_loss(advantages, loss_mask, constants, token_weights, bonus_weights, settings)
            request = dataclasses.replace(request, token_loss=token_loss, into_grad=into_grad)
        tokens = Tokens(prompt_ids, prompt_mask, completion_ids, completion_mask, rows_of(exp.vision, index))
        result = self.run_pass(self.model, tokens, request)
        logp, entropy = result.logprobs, result.entropies
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
            loss = result.loss
        metrics["entropy"] = masked_mean(entropy.detach(), loss_mask)
        policy_tokens = loss_mask if threshold is None else loss_mask * (entropy.detach() >= threshold)
        stats = torch.stack([(entropy.detach() * policy_tokens).sum(), policy_tokens.sum()]).float()
        return loss, metrics, stats

    @property
    def touches_every_parameter(self) -> bool:
        """DDP over a vision-language model: some parameters get no gradient from a micro-batch (the tower from
        one without images, LLaVA-NeXT's unused last vision layer), which DDP's reducer cannot wait for, and its
        find_unused_parameters cannot see the head, whose gradient the passes compute outside the model's forward.
        Every parameter then gets an exact zero added to its gradient (`every_parameter`)."""
        return self.vision_language and isinstance(self.model, torch.nn.parallel.DistributedDataParallel)

    def fuses_loss(self, settings: LossSettings) -> bool:
        """The training loss runs inside the head's chunks (`algorithms.head_token_loss`): a token-separable loss,
        the whole-batch entropy quantile off, a plain linear head, and a head large enough for its fourth product
        to matter (FUSED_LOSS_MIN_HEAD parameters; below that the bookkeeping costs more than it saves)."""
        head = output_head(self.model)
        return (token_separable(settings) and self.args.top_entropy_quantile == 1.0 and type(head) is torch.nn.Linear
                and head.weight.numel() >= FUSED_LOSS_MIN_HEAD)

    @staticmethod
    def _token_loss(advantages, mask, constants, token_weights, bonus_weights, settings):
        """token_loss(logp, entropy, rows, cols) for a pass (`PassRequest.token_loss`): the micro-batch's loss restricted to
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
        tokens = Tokens(exp.prompt_ids, exp.prompt_mask, exp.completion_ids, exp.completion_mask, exp.vision)
        result = self.run_pass(self.model, tokens, PassRequest(entropy=self.settings.entropy_coef != 0.0))
        logp, entropy = result.logprobs, result.entropies
        device = self.comm.device
        batch = LossBatch(logp, exp.advantages.to(device), exp.loss_mask.to(device),
                          ref_logp=None if exp.ref_logp is None else exp.ref_logp.to(device), entropy=entropy)
        return policy_loss(batch, self.settings)[0].item()


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


def every_parameter(model) -> torch.Tensor:
    """0 x (one element of every trainable parameter): added to a loss, every parameter gets a gradient (of exact
    zeros where nothing else reached it), at the cost of one element each."""
    touched = [p.view(-1)[:1] for p in model.parameters() if p.requires_grad]
    return torch.cat(touched).sum() * 0.0 if touched else torch.zeros(())


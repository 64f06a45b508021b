"""Loss and gradient of grpokit against TRL's GRPOTrainer._compute_loss on identical fixed inputs.

Same model (one object), same prompt and completion ids, same masks, same advantages (fed to both, so TRL's 1e-4
epsilon in the std denominator plays no part), same reference log-probs. Prompts have equal lengths: TRL
derives no position ids from the attention mask, so left-padded prompts would differ by design, not by error.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from datasets import Dataset

from grpokit.algorithms import policy_loss
from grpokit.logprob_pass import completion_logprobs
from grpokit.tiny import char_tokenizer
from workloads import BETA, COMPLETION_LENGTH, WORKLOADS, build_model_dir, count_vowels, prompts

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")


def fixed_inputs(vocab_size: int, rows: int = 16, prompt_length: int = 14, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(2, vocab_size, (rows, COMPLETION_LENGTH), generator=g)
    ends = torch.randint(4, COMPLETION_LENGTH + 8, (rows,), generator=g)  # some rows end early, some never
    positions = torch.arange(COMPLETION_LENGTH)
    ended = ends < COMPLETION_LENGTH
    completion_ids[ended, ends[ended]] = 1  # EOS ends the row; pad (0) after it
    completion_ids = torch.where(positions <= ends.unsqueeze(-1), completion_ids, torch.zeros_like(completion_ids))
    completion_mask = (positions <= ends.unsqueeze(-1)).long()
    distinct = torch.randint(2, vocab_size, (2, prompt_length), generator=g)  # 2 prompts x rows/2 completions
    return {
        "prompt_ids": distinct.repeat_interleave(rows // 2, 0),
        "prompt_mask": torch.ones(rows, prompt_length, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.randn(rows, generator=g),
        "ref_per_token_logps": -torch.rand(rows, COMPLETION_LENGTH, generator=g) * 5,
    }


def grpokit_loss(model, inputs: dict, loss_type: str, temperature: float = 1.0) -> torch.Tensor:
    """The trainer's path: shared-prompt forward to hidden states, the fused head (head_logprobs), policy_loss."""
    logp, _ = completion_logprobs(
        model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
        temperature,
    )
    mask = inputs["completion_mask"]
    loss, _ = policy_loss(
        logp, None, inputs["advantages"], mask, inputs["ref_per_token_logps"], beta=BETA, loss_type=loss_type,
        max_completion_length=COMPLETION_LENGTH, num_micro_batches=1, token_normalizer=mask.sum().float(),
    )
    return loss


def trl_trainer(model_dir: str, out_dir: str, loss_type: str):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=16,
        num_generations=8, max_completion_length=COMPLETION_LENGTH, beta=BETA, loss_type=loss_type,
        gradient_checkpointing=False, use_bias_correction_kl=False,
    )
    trainer = GRPOTrainer(model_dir, count_vowels, args=args, train_dataset=Dataset.from_dict({"prompt": prompts()}),
                          processing_class=char_tokenizer())
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def _loss_and_grads(model, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_math() -> list[dict]:
    """Max |grpokit - TRL| of the loss and of every parameter's gradient, per loss_type."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        build_model_dir(WORKLOADS["small"], Path(folder) / "model")
        for loss_type in LOSS_TYPES:
            trainer = trl_trainer(str(Path(folder) / "model"), str(Path(folder) / "out"), loss_type)
            model = trainer.model
            model.train()
            inputs = fixed_inputs(model.config.vocab_size)
            trl_inputs = {**inputs, "old_per_token_logps": None,
                          "num_items_in_batch": inputs["completion_mask"].sum().float()}
            loss_trl, grads_trl = _loss_and_grads(model, lambda: trainer._compute_loss(model, trl_inputs))
            loss_ours, grads_ours = _loss_and_grads(model, lambda: grpokit_loss(model, inputs, loss_type))
            assert grads_trl.keys() == grads_ours.keys()
            grad_diffs = {n: (grads_trl[n] - grads_ours[n]).abs().max().item() for n in grads_trl}
            worst = max(grad_diffs, key=grad_diffs.get)
            results.append({
                "loss_type": loss_type, "loss_trl": loss_trl.item(), "loss_grpokit": loss_ours.item(),
                "loss_abs_diff": (loss_trl - loss_ours).abs().item(), "grad_max_abs_diff": grad_diffs[worst],
                "worst_param": worst, "params_compared": len(grad_diffs),
                "grad_max_abs": max(g.abs().max().item() for g in grads_trl.values()),
                "grad_abs_diff_per_param": {n: float(f"{d:.3g}") for n, d in grad_diffs.items()},
            })
    return results

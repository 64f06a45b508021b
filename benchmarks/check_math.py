"""grpokit's GRPO math against TRL 1.16's own implementation, on identical inputs.

Losses and gradients: one model object, fixed prompt and completion ids and masks, fixed advantages, reference
log-probs and old log-probs (the current ones plus noise, so importance weights differ from 1 and clipping, the
off-policy mask and bias-corrected KL all act), fed to `trl.GRPOTrainer._compute_loss` and to grpokit's trainer
path (`completion_logprobs` with the fused head -> `LossBatch` -> `policy_loss` with `loss_settings(GRPOConfig)`).
The same option dict builds both trainers' configs. Prompts have equal lengths: TRL derives no position ids from
the attention mask, so left-padded prompts would differ by design, not by error.

Advantages: TRL's `_generate_and_score_completions` (its own inline code) with `_calculate_rewards` replaced by a
fixed reward matrix (None entries, a completion nobody scored, a flat group), against `group_advantages`.

    python benchmarks/check_math.py            # prints one JSON line per case
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path

import torch
from datasets import Dataset

from grpokit.algorithms import ADVANTAGE_ESTIMATORS, LossBatch, entropy_quantile_threshold, group_advantages, policy_loss
from grpokit.config import GRPOConfig as GrpokitConfig
from grpokit.passes import completion_logprobs
from grpokit.tiny import char_tokenizer
from grpokit.train.learner import loss_settings
from workloads import BETA, WORKLOADS, build_model_dir, count_vowels, prompts

COMPLETION_LENGTH = 48
ROWS, GROUP = 16, 8
# Each case is the option dict given to both GRPOConfigs (TRL's and grpokit's); every case also has beta = BETA,
# use_bias_correction_kl = False and old log-probs that differ from the current ones unless it says otherwise.
LOSS_CASES: dict[str, dict] = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "sapo": {"loss_type": "sapo"},
    "luspo (sequence level)": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
    "gspo (dapo, sequence level)": {"loss_type": "dapo", "importance_sampling_level": "sequence"},
    "grpo, on-policy (old = current)": {"loss_type": "grpo", "_on_policy": True},
    "grpo, beta 0": {"loss_type": "grpo", "beta": 0.0},
    "grpo, use_bias_correction_kl": {"loss_type": "grpo", "use_bias_correction_kl": True},
    "dapo sequence, use_bias_correction_kl": {"loss_type": "dapo", "importance_sampling_level": "sequence",
                                              "use_bias_correction_kl": True},
    "cispo, use_bias_correction_kl": {"loss_type": "cispo", "epsilon_high": 5.0, "use_bias_correction_kl": True},
    "grpo, top_entropy_quantile 0.2": {"loss_type": "grpo", "top_entropy_quantile": 0.2},
    "sapo, top_entropy_quantile 0.5": {"loss_type": "sapo", "top_entropy_quantile": 0.5},
    "dapo, entropy_coef 0.01": {"loss_type": "dapo", "entropy_coef": 0.01},
    "grpo, entropy_coef 0.01, top_entropy_quantile 0.2": {"loss_type": "grpo", "entropy_coef": 0.01,
                                                          "top_entropy_quantile": 0.2},
    "bnpo, off_policy_mask_threshold 0.05": {"loss_type": "bnpo", "off_policy_mask_threshold": 0.05},
    "dapo, epsilon_high 0.28, delta 1.5": {"loss_type": "dapo", "epsilon_high": 0.28, "delta": 1.5},
    "vespo, custom k and lambda": {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
                                   "vespo_k_neg": 2.0, "vespo_lambda_neg": 1.5},
    "sapo, custom temperatures": {"loss_type": "sapo", "sapo_temperature_pos": 0.5, "sapo_temperature_neg": 2.0},
}
SCALES = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")
REWARD_WEIGHTS = (1.0, 0.5)
ADVANTAGE_GROUP = 4  # 16 completions = 4 groups of 4


def fixed_inputs(vocab_size: int, seed: int = 1, prompt_length: int = 14) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    completion_ids = torch.randint(2, vocab_size, (ROWS, COMPLETION_LENGTH), generator=g)
    ends = torch.randint(4, COMPLETION_LENGTH + 8, (ROWS,), generator=g)  # some rows end early, some never
    positions = torch.arange(COMPLETION_LENGTH)
    ended = ends < COMPLETION_LENGTH
    completion_ids[ended, ends[ended]] = 1  # EOS ends the row; pad (0) after it
    completion_ids = torch.where(positions <= ends.unsqueeze(-1), completion_ids, torch.zeros_like(completion_ids))
    distinct = torch.randint(2, vocab_size, (ROWS // GROUP, prompt_length), generator=g)
    return {
        "prompt_ids": distinct.repeat_interleave(GROUP, 0),
        "prompt_mask": torch.ones(ROWS, prompt_length, dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": (positions <= ends.unsqueeze(-1)).long(),
        "advantages": torch.randn(ROWS, generator=g),
        "ref_per_token_logps": -torch.rand(ROWS, COMPLETION_LENGTH, generator=g) * 5,
        # old = current + a per-row drift (some rows far enough off-policy for the mask) + per-token noise
        "_drift": (torch.rand(ROWS, 1, generator=g) - 0.5) * 0.4 + 0.3 * torch.randn(ROWS, COMPLETION_LENGTH,
                                                                                     generator=g),
    }


def _options(case: dict) -> dict:
    options = {"beta": BETA, "use_bias_correction_kl": False, **case}
    options.pop("_on_policy", None)
    return options


def trl_trainer(model_dir: str, out_dir: str, num_generations: int, reward_funcs, **options):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=ROWS,
        num_generations=num_generations, gradient_checkpointing=False,
        **{"max_completion_length": COMPLETION_LENGTH, **options},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model_dir, reward_funcs, args=args, processing_class=char_tokenizer(),
                              train_dataset=Dataset.from_dict({"prompt": prompts()}))
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def grpokit_loss(model, inputs: dict, options: dict, out_dir: str) -> torch.Tensor:
    """The trainer's path: shared-prompt forward, the fused head, a LossBatch and the config's LossSettings."""
    config = GrpokitConfig(output_dir=out_dir, per_device_train_batch_size=ROWS, num_generations=GROUP,
                           max_completion_length=COMPLETION_LENGTH, **options)
    settings = loss_settings(config)
    logp, entropy = completion_logprobs(
        model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"], inputs["completion_mask"],
        with_entropy=True, entropy_grad=settings.entropy_coef != 0.0,
    )
    mask = inputs["completion_mask"]
    threshold = None
    if config.top_entropy_quantile < 1.0:
        threshold = entropy_quantile_threshold(entropy.detach()[mask.bool()], config.top_entropy_quantile)
    batch = LossBatch(
        logp, inputs["advantages"], mask, old_logp=inputs["old_per_token_logps"],
        ref_logp=inputs["ref_per_token_logps"], entropy=entropy, entropy_threshold=threshold, num_micro_batches=1,
        token_normalizer=mask.sum().float(),
    )
    return policy_loss(batch, settings)[0]


def _loss_and_grads(model, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = compute()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _old_logps(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        current, _ = completion_logprobs(model, inputs["prompt_ids"], inputs["prompt_mask"],
                                         inputs["completion_ids"], inputs["completion_mask"])
    return current + inputs["_drift"]


def check_losses(cases: dict[str, dict] | None = None) -> list[dict]:
    """Per case: both losses, |diff| of the loss and the max |diff| over every parameter's gradient."""
    results = []
    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(Path(folder) / "model")
        build_model_dir(WORKLOADS["small"], Path(model_dir))
        for name, case in (cases or LOSS_CASES).items():
            options = _options(case)
            trainer = trl_trainer(model_dir, str(Path(folder) / "trl"), GROUP, count_vowels, **options)
            model = trainer.model
            model.train()
            inputs = fixed_inputs(model.config.vocab_size)
            inputs["old_per_token_logps"] = None if case.get("_on_policy") else _old_logps(model, inputs)
            trl_inputs = {k: v for k, v in inputs.items() if not k.startswith("_")}
            trl_inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
            loss_trl, grads_trl = _loss_and_grads(model, lambda: trainer._compute_loss(model, trl_inputs))
            loss_ours, grads_ours = _loss_and_grads(
                model, lambda: grpokit_loss(model, inputs, options, str(Path(folder) / "ours")))
            assert grads_trl.keys() == grads_ours.keys(), name
            diffs = {n: (grads_trl[n] - grads_ours[n]).abs().max().item() for n in grads_trl}
            worst = max(diffs, key=diffs.get)
            results.append({
                "case": name, "loss_trl": loss_trl.item(), "loss_grpokit": loss_ours.item(),
                "loss_abs_diff": (loss_trl - loss_ours).abs().item(), "grad_max_abs_diff": diffs[worst],
                "worst_param": worst, "params_compared": len(diffs),
                "grad_max_abs": max(g.abs().max().item() for g in grads_trl.values()),
            })
    return results


def fixed_rewards(seed: int = 3) -> torch.Tensor:
    """(16, 2) rewards in 4 groups of 4: None (NaN) entries, one completion no function scored, ties, one group
    flat in every function."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 5, (ROWS, len(REWARD_WEIGHTS)), generator=g).float() / 4
    rewards[torch.rand(ROWS, len(REWARD_WEIGHTS), generator=g) < 0.25] = float("nan")
    rewards[5] = float("nan")  # nobody scored completion 5
    rewards[12:16] = torch.tensor([0.5, 1.0])  # group 3 is flat in both functions
    return rewards


def trl_advantages(trainer, rewards: torch.Tensor, scale_rewards: str, aggregation: str) -> torch.Tensor:
    """TRL's own advantage code (inline in _generate_and_score_completions) on `rewards`."""
    trainer.scale_rewards, trainer.multi_objective_aggregation = scale_rewards, aggregation
    trainer._calculate_rewards = lambda *args, **kwargs: rewards.clone()
    inputs = [{"prompt": p} for p in prompts()[:ROWS // ADVANTAGE_GROUP] for _ in range(ADVANTAGE_GROUP)]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer._generate_and_score_completions(inputs)["advantages"].float()


def _trl_batch_eps_factor(rewards: torch.Tensor, weights: torch.Tensor, aggregation: str) -> float:
    """std / (std + 1e-4) of normalize_then_sum's batch step (the sums of per-function group z-scores), the one
    place TRL's epsilon still acts when the rewards are scaled up; 1 for sum_then_normalize."""
    if aggregation == "sum_then_normalize":
        return 1.0
    grouped = rewards.double().reshape(-1, ADVANTAGE_GROUP, rewards.shape[1])
    applicable = ~torch.isnan(grouped)
    z = ADVANTAGE_ESTIMATORS["grpo"](torch.nan_to_num(grouped), applicable, "group")
    sums = torch.where(applicable, z * weights.double(), torch.zeros_like(z)).sum(-1)[applicable.any(-1)]
    std = sums.std().item()
    return std / (std + 1e-4)


def check_advantages(scale: float = 1e6) -> list[dict]:
    """Per scale_rewards x multi_objective_aggregation: max |TRL - grpokit| on the rewards as they are, and on the
    rewards times `scale`, where TRL's 1e-4 in the std no longer counts (grpokit is invariant to the scale except
    under scale_rewards "none", which divides by nothing in both)."""
    def zero(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    results = []
    rewards = fixed_rewards()
    weights = torch.tensor(REWARD_WEIGHTS)
    with tempfile.TemporaryDirectory() as folder:
        model_dir = str(Path(folder) / "model")
        build_model_dir(WORKLOADS["small"], Path(model_dir))
        trainer = trl_trainer(model_dir, str(Path(folder) / "trl"), ADVANTAGE_GROUP, [zero, zero],
                              reward_weights=list(REWARD_WEIGHTS), max_completion_length=8)
        for aggregation in AGGREGATIONS:
            for scale_rewards in SCALES:
                ours, _ = group_advantages(rewards.double(), weights.double(), ADVANTAGE_GROUP, aggregation,
                                           scale_rewards)
                # TRL ignores scale_rewards under normalize_then_sum (each function by its group std): compare
                # grpokit's "group" there, the one meaning the two share
                ours_like_trl = ours if aggregation == "sum_then_normalize" else group_advantages(
                    rewards.double(), weights.double(), ADVANTAGE_GROUP, aggregation, "group")[0]
                trl = trl_advantages(trainer, rewards, scale_rewards, aggregation).double()
                unscaled = scale_rewards == "none" and aggregation == "sum_then_normalize"  # A scales with R
                trl_scaled = trl_advantages(trainer, rewards * scale, scale_rewards, aggregation).double() / (
                    scale if unscaled else 1.0)
                pinned = ours_like_trl * _trl_batch_eps_factor(rewards, weights, aggregation)
                results.append({
                    "scale_rewards": scale_rewards, "multi_objective_aggregation": aggregation,
                    "max_abs_diff": (trl - ours_like_trl).abs().max().item(),
                    "max_abs_diff_rewards_x1e6": (trl_scaled - ours_like_trl).abs().max().item(),
                    "max_abs_diff_rewards_x1e6_eps_pinned": (trl_scaled - pinned).abs().max().item(),
                    "max_abs_advantage": ours_like_trl.abs().max().item(),
                    "grpokit": [round(v, 6) for v in ours.tolist()], "trl": [round(v, 6) for v in trl.tolist()],
                })
    return results


def check_math() -> list[dict]:
    return check_losses() + check_advantages()


if __name__ == "__main__":
    for row in check_math():
        print(json.dumps(row))

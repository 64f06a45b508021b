"""Evaluation: eval prompts through the collector (episodes, scoring) and the learner's own loss.

    result = evaluator.run(sets, prompt_ids, state)   # {"eval/reward": ..., "eval/<set>/loss": ..., ...}

Each eval prompt gets num_generations_eval sampled completions (the same sampler as training, on sample ids
apart from the training ones), generated per_device_eval_batch_size at a time. Every process evaluates every row
(the counter-based sampler makes their results identical), which keeps their collective calls in step.
"""

from __future__ import annotations

import torch

from grpokit.algorithms import group_advantages
from grpokit.config import ConfigError
from grpokit.rollout.multiturn import Episodes
from grpokit.train.batches import TrainerState
from grpokit.train.collector import Collector, episode_stats
from grpokit.train.learner import Learner
from grpokit.train.setup import Setup
from grpokit.train.telemetry import eval_metric_summary, tool_metrics

EVAL_SAMPLE_OFFSET = 2**40  # eval completions' sample ids start here, apart from the training samples' ids


class Evaluator:
    """Mean rewards, the loss and compute_metrics of sampled completions of the eval sets."""

    def __init__(self, setup: Setup, collector: Collector, learner: Learner) -> None:
        self.setup, self.collector, self.learner = setup, collector, learner

    @torch.no_grad()
    def run(self, sets: dict, prompt_ids: dict, state: TrainerState) -> dict[str, float]:
        """eval/reward, eval/loss, eval/rewards/<function>/mean, tool metrics with tools or environments, and the
        compute_metrics results (eval_metric_summary); a named eval set's under eval/<name>/."""
        if not sets:
            raise ConfigError("evaluate() needs an eval_dataset; pass eval_dataset=... to GRPOTrainer.")
        result: dict[str, float] = {"step": state.global_step}
        for name, dataset in sets.items():
            prefix = "eval/" if name is None else f"eval/{name}/"
            result.update(self.run_set(dataset, prompt_ids[name], prefix, state))
        return result

    def run_set(self, dataset, ids: list[list[int]], prefix: str, state: TrainerState) -> dict[str, float]:
        args, rewards_setup = self.setup.args, self.setup.rewards
        group = args.num_generations_eval or args.num_generations
        rows = [r for r in range(len(dataset)) for _ in range(group)]
        chunk = args.eval_batch_size  # per_device_eval_batch_size, default the process's training generation batch
        scores, metric_scores, chunks = [], [], []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            sample_ids = torch.arange(start, start + len(part)) + EVAL_SAMPLE_OFFSET
            episodes = self.collector.episodes(dataset, part, [ids[r] for r in part], sample_ids,
                                               where=prefix.rstrip("/").replace("eval", "eval_dataset", 1))
            chunks.append(episodes)
            scores.append(self.collector.score_here(dataset, part, episodes, state))
            if rewards_setup.metric_funcs:
                metric_scores.append(self.collector.score_here(dataset, part, episodes, state,
                                                               rewards_setup.metric_funcs))
        rewards = torch.cat(scores)  # (rows, F)
        advantages, stats = group_advantages(rewards, rewards_setup.weights, group, args.multi_objective_aggregation,
                                             args.scale_rewards, args.advantage_estimator)
        result = {f"{prefix}reward": torch.nanmean(stats["reward"]).item(),
                  f"{prefix}loss": self.loss(chunks, advantages)}
        if self.setup.agent.agentic:
            result.update(tool_metrics(torch.cat([episode_stats(e) for e in chunks]), prefix))
        for k, name in enumerate(rewards_setup.names):
            result[f"{prefix}rewards/{name}/mean"] = torch.nanmean(rewards[:, k]).item()
        if rewards_setup.metric_funcs:
            values = torch.cat(metric_scores).reshape(len(dataset), group, -1)  # (prompts, G, metrics)
            for k, func in enumerate(rewards_setup.metric_funcs):
                result.update(eval_metric_summary(func.name, values[..., k], prefix))
        return result

    def loss(self, chunks: list[Episodes], advantages: torch.Tensor) -> float:
        """The training loss on the eval completions, on-policy (every ratio 1), from their group advantages
        (outcome rewards only): the mean over the completions of each chunk's loss, chunks weighted by their
        completions."""
        total, start = 0.0, 0
        for episodes in chunks:
            n = len(episodes.prompt_ids)
            experience = self.learner.evaluation_experience(episodes.prompt_ids, episodes.rollout,
                                                            advantages[start : start + n], episodes.vision)
            total += self.learner.evaluation_loss(experience) * n
            start += n
        return total / max(start, 1)


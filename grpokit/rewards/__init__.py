"""Reward functions for GRPO: the contract, the built-ins, reward models, HTTP rewards and the code sandbox.

The trainer uses two calls:

    funcs = resolve_reward_funcs(specs, reward_model_kwargs=None, max_completion_length=None)
    scores = score_completions(funcs, prompts, completions, completion_ids, columns, trainer_state,
                               error_policy="raise")     # scores.rewards: (N, F) float32, NaN = None
    # scores.steps[f]: a process (step) reward's (end_offset, reward) lists, None for an outcome reward

See docs/rewards.md for the contract, every built-in's formula, and what the sandbox protects against.
"""

from grpokit.rewards.answer_rewards import ExactMatchReward, MathAccuracyReward
from grpokit.rewards.code_reward import CodeExecutionReward, parse_test_cases
from grpokit.rewards.contract import RewardError, RewardFunction, RewardScores, score_completions
from grpokit.rewards.format_rewards import RegexFormatReward, RepetitionPenalty, TagStructureReward
from grpokit.rewards.http_reward import HTTPRewardFunction
from grpokit.rewards.length_rewards import LengthPenalty, SoftOverlongPunishment, soft_overlong_punishment
from grpokit.rewards.registry import BUILTIN_REWARDS, resolve_reward_funcs
from grpokit.rewards.reward_model import RewardModelFunction
from grpokit.sandbox import Sandbox, SandboxConfig, SandboxResult, run_python, sandbox_protections
from grpokit.rewards.steps import StepReward, offsets_to_token_indices, split_steps, token_char_ends

__all__ = [
    "BUILTIN_REWARDS",
    "CodeExecutionReward",
    "ExactMatchReward",
    "HTTPRewardFunction",
    "LengthPenalty",
    "MathAccuracyReward",
    "RegexFormatReward",
    "RepetitionPenalty",
    "RewardError",
    "RewardFunction",
    "RewardModelFunction",
    "RewardScores",
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SoftOverlongPunishment",
    "StepReward",
    "TagStructureReward",
    "offsets_to_token_indices",
    "parse_test_cases",
    "resolve_reward_funcs",
    "run_python",
    "sandbox_protections",
    "score_completions",
    "soft_overlong_punishment",
    "split_steps",
    "token_char_ends",
]

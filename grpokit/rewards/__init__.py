"""Reward functions for GRPO: the contract, the built-ins, reward models, HTTP rewards and the code sandbox.

The trainer uses two calls:

    funcs = resolve_reward_funcs(specs, reward_model_kwargs=None, max_completion_length=None)
    scores = score_completions(funcs, prompts, completions, completion_ids, columns, trainer_state,
                               error_policy="raise")     # scores.rewards: (N, F) float32, NaN = None
    # scores.steps[f]: a process (step) reward's (end_offset, reward) lists, None for an outcome reward

See docs/rewards.md for the contract, every built-in's formula, and what the sandbox protects against.

The names below are imported on first use, so that a light module of the package (the contract, whose
ERROR_POLICIES the config checks reward_error_policy against) does not bring in the reward models and the sandbox.
"""

import importlib
from typing import Any

# name -> the module that defines it
_HOMES = {
    **dict.fromkeys(["ExactMatchReward", "MathAccuracyReward"], "grpokit.rewards.answer_rewards"),
    **dict.fromkeys(["CodeExecutionReward", "parse_test_cases"], "grpokit.rewards.code_reward"),
    **dict.fromkeys(["RewardError", "RewardFunction", "RewardScores", "score_completions"], "grpokit.rewards.contract"),
    **dict.fromkeys(["RegexFormatReward", "RepetitionPenalty", "TagStructureReward"], "grpokit.rewards.format_rewards"),
    "HTTPRewardFunction": "grpokit.rewards.http_reward",
    **dict.fromkeys(["LengthPenalty", "SoftOverlongPunishment", "soft_overlong_punishment"],
                    "grpokit.rewards.length_rewards"),
    **dict.fromkeys(["BUILTIN_REWARDS", "resolve_reward_funcs"], "grpokit.rewards.registry"),
    "RewardModelFunction": "grpokit.rewards.reward_model",
    **dict.fromkeys(["Sandbox", "SandboxConfig", "SandboxResult", "run_python", "sandbox_protections"],
                    "grpokit.sandbox"),
    **dict.fromkeys(["StepReward", "offsets_to_token_indices", "split_steps", "token_char_ends"],
                    "grpokit.rewards.steps"),
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value

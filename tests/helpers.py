"""Reward functions and small utilities used by several test files."""

import json
from pathlib import Path


def frac_a(prompts, completions, **kwargs):
    """Fraction of the completion's characters that are 'a' (a reward the tiny model can learn fast)."""
    return [c.count("a") / max(1, len(c)) for c in completions]


def short(prompts, completions, **kwargs):
    return [-len(c) / 10 for c in completions]


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def call_policy_loss(logp, old_logp, advantages, mask, ref_logp=None, *, loss_type="dapo", num_micro_batches=1,
                     token_normalizer=None, sampling_weights=None, sampling_logp=None, entropy=None,
                     entropy_threshold=None, **settings):
    """policy_loss from positional tensors and keyword settings (loss_type names the aggregation)."""
    from grpokit.algorithms import LossBatch, LossSettings, policy_loss

    batch = LossBatch(
        logp, advantages, mask, old_logp=old_logp, ref_logp=ref_logp, sampling_logp=sampling_logp,
        sampling_weights=sampling_weights, entropy=entropy, entropy_threshold=entropy_threshold,
        num_micro_batches=num_micro_batches, token_normalizer=token_normalizer,
    )
    return policy_loss(batch, LossSettings(loss_aggregation=loss_type, **settings))


def echo(text: str) -> str:
    """Repeat a text in capitals.

    Args:
        text: The text.
    """
    return text.upper()


class EveryTurnCalls:
    """A tool-call format that reads every turn as a call to echo with its first three characters, so that a
    random model makes tool calls (registered as "test_every_turn" by register_test_formats)."""

    name = "test_every_turn"

    def parse(self, text):
        from grpokit.tools import ToolCall

        return [ToolCall("echo", {"text": text[:3]})]

    def render_results(self, results):
        return "".join(f"[{r.content}]" for r in results)


def register_test_formats():
    from grpokit.tools import TOOL_CALL_FORMATS

    TOOL_CALL_FORMATS.register("test_every_turn", EveryTurnCalls)

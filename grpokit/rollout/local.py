"""The "local" rollout engine: grpokit's own decode loop on the live policy, in the training process.

Its guarantee, which no other engine here gives: the token drawn for completion c at position t is an inverse-CDF
draw with a uniform hashed from (seed, c, t) (grpokit/rollout/sampling.py). So a completion's tokens do not depend
on which other completions share the batch, on how many processes split the batch, or on anything but the weights;
a resumed run regenerates bit-identical batches on the same machine (pinned by tests/test_distributed.py and
tests/test_reliability.py). It reads the model's weights directly, so `sync_weights` has nothing to do, and its
log-probs are exactly those of the distribution it sampled from, computed from the same sums as the draw.
"""

from __future__ import annotations

from grpokit.rollout.engine import EngineContext, Rollout, RolloutRequest, register_rollout_engine
from grpokit.rollout.generate import generate_completions


class LocalEngine:
    name = "local"

    def __init__(self, context: EngineContext) -> None:
        self.model = context.model
        self.tokenizer = context.tokenizer
        self.autocast = context.autocast
        self.sharded = context.sharded

    def generate(self, request: RolloutRequest) -> Rollout:
        with self.autocast():
            return generate_completions(
                self.model, self.tokenizer, request.prompt_ids, request.sample_ids, request.params, request.seed,
                return_logprobs=request.return_logprobs, lockstep=request.lockstep, sharded=self.sharded,
                vision=request.vision,
            )

    def sync_weights(self, weights, version: int) -> None:
        """Nothing to copy: the loop reads the live model."""

    def close(self) -> None:
        pass


@register_rollout_engine("local")
def local_engine(context: EngineContext) -> LocalEngine:
    return LocalEngine(context)

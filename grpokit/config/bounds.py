"""The bounds several GRPOConfig options share (in the Ranges of grpokit/config/fields.py), and the automatic
token budget's floor."""

from __future__ import annotations

from typing import Annotated

from grpokit.config.checks import Range

# The bounds several options share. Each numeric option declares its Range beside its type (Annotated[int,
# Range(low, high)]); checks.numeric_problems refuses, naming the option, every value that is not a number of that
# type inside it, and `grpo train --help` prints it. The ranges are wider than any real run and refuse what would
# hang, overflow or train on nonsense: 1e30 learning rates, 1e12 batches, 1.5 steps, a seed numpy refuses.
MAX_STEPS = 10**9  # optimizer steps and step intervals
MAX_BATCH = 2**16  # completions per micro-batch, micro-batches per step or generation, completions per prompt
MAX_GENERATION_BATCH = 2**20  # completions in one generation batch of one process (check_geometry)
MAX_TOKENS = 2**24  # tokens of a prompt or a completion; top_k
AUTO_TOKEN_BUDGET = 2048  # the smallest automatic token_budget: below it a CPU's matmuls lose speed (performance.md)
Steps = Annotated[int, Range(1, MAX_STEPS)]

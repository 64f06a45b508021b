"""A reward that only waits: every scoring call sleeps SLOW_REWARD_SECONDS and returns None (does not apply).

It makes steps slow enough for a signal or a kill to land mid-run without changing any reward, so a run that
sleeps and one that does not log the same numbers. Used by train_tiny.py --reward-sleep and the CLI tests.
"""

import os
import time


def slow(prompts, completions, **kwargs):
    time.sleep(float(os.environ.get("SLOW_REWARD_SECONDS", "0")))
    return [None] * len(completions)

"""Train the tiny test model on multi-turn episodes from the command line (tests/test_fsdp2_engines.py).

usage: train_multiturn.py MODEL_DIR OUTPUT_DIR (--tools 1 | --environment 1) [--option value ...]

--tools 1: the `echo` tool, every turn read as a call to it (tests/helpers.py: test_every_turn);
--environment 1: a responding environment that answers "+" to `turns` turns of its row (0 for prompts 0, 1, 4, 5,
...; 3 for 2, 3, 6, 7, ...), then ends the episode; it scores the answers it had left.
Unsharded (shuffle_dataset false), process 0 takes prompts whose episodes end after one turn and process 1 prompts
whose episodes go on, so the processes make different numbers of generation calls. Each process writes
OUTPUT_DIR/calls-RANK.json: the number of engine calls of every `episodes` batch (training rounds, evaluation).
Other options are GRPOConfig fields.
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # this checkout's grpokit
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import datasets  # noqa: E402

import grpokit.train.collector as collector_module  # noqa: E402
from grpokit.config import GRPOConfig, coerce_option  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402
from helpers import echo, register_test_formats, short  # noqa: E402


class Answering:
    """Answers "+" to `turns` model turns, then ends the episode; reward: the answers it had left (0 when used)."""

    def reset(self, turns, **row):
        self.left = int(turns)
        return None

    def respond(self, text):
        if self.left == 0:
            return None
        self.left -= 1
        return "+"

    def get_reward(self):
        return float(self.left)


def count_calls(output_dir: str) -> None:
    """Wrap Collector.episodes and Collector.generate: the calls of each episodes batch, written at every batch."""
    calls: list[int] = []
    path = Path(output_dir) / f"calls-{os.environ.get('RANK', '0')}.json"
    episodes, generate = collector_module.Collector.episodes, collector_module.Collector.generate

    def counted_generate(self, *args, **kwargs):
        calls[-1] += 1
        return generate(self, *args, **kwargs)

    def counted_episodes(self, *args, **kwargs):
        calls.append(0)
        result = episodes(self, *args, **kwargs)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(calls))
        return result

    collector_module.Collector.generate = counted_generate
    collector_module.Collector.episodes = counted_episodes


def main() -> None:
    model_dir, output_dir, *rest = sys.argv[1:]
    options = dict(output_dir=output_dir, num_generations=4, max_completion_length=24, learning_rate=1e-2,
                   disable_tqdm=True, seed=0, logging_steps=1, shuffle_dataset=False, log_completions=False,
                   max_tool_calling_iterations=3)
    tools, factory = [], None
    for key, value in zip(rest[::2], rest[1::2]):
        key = key.lstrip("-")
        if key == "tools" and int(value):
            register_test_formats()
            tools = [echo]
            options["tool_call_format"] = "test_every_turn"
        elif key == "environment" and int(value):
            factory = Answering
        else:
            options[key] = coerce_option(key, value)
    count_calls(output_dir)
    rows = [{"prompt": f"{i}+{i}=", "turns": 3 * ((i // 2) % 2)} for i in range(16)]
    dataset = datasets.Dataset.from_list(rows)
    eval_dataset = datasets.Dataset.from_list(rows[:4])
    trainer = GRPOTrainer(model_dir, [short], GRPOConfig(**options), dataset, eval_dataset=eval_dataset,
                          tools=tools, environment_factory=factory)
    trainer.train()


if __name__ == "__main__":
    main()

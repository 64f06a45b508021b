"""Train the tiny test model from the command line: used by the multi-process and kill/resume tests.

usage: train_tiny.py MODEL_DIR OUTPUT_DIR [--resume] [--raise-on-rank R] [--reward-sleep S] [--die-in-save STEP]
                     [--flat-even 1] [--lora-r R] [--eval 1] [--option value ...]
Options are GRPOConfig fields; the reward is `short` (shorter completions score higher), with signal at step 1.
Test hooks, all in this script (the library has none): --raise-on-rank R adds a reward that raises on rank R;
--reward-sleep S makes every scoring call sleep S seconds (slow steps, so a signal lands mid-run);
--die-in-save STEP SIGKILLs the process while checkpoint-STEP is complete in its staging folder but not yet renamed;
--flat-even 1 scores every completion of an even-numbered prompt 1.0 (groups without signal, for dynamic sampling);
--tools-every-turn 1 gives the model the `echo` tool and reads every turn as a call to it (multi-turn episodes);
--lora-r R trains a LoRA adapter of rank R on q_proj and v_proj (peft_config); --eval 1 evaluates on 4 prompts.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # this checkout's grpokit, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import datasets  # noqa: E402

from grpokit.config import GRPOConfig, coerce_option  # noqa: E402
from grpokit.trainer import GRPOTrainer  # noqa: E402
from helpers import short  # noqa: E402


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # shows "Resumed from ..."
    model_dir, output_dir, *rest = sys.argv[1:]
    resume = "--resume" in rest
    rest = [a for a in rest if a != "--resume"]
    options = dict(output_dir=output_dir, num_generations=4, max_completion_length=8, learning_rate=1e-2,
                   disable_tqdm=True, seed=0, logging_steps=1)
    raise_on_rank, reward_sleep, die_in_save, flat_even, tools = None, 0.0, None, False, []
    peft_config, evaluate = None, False
    for key, value in zip(rest[::2], rest[1::2]):
        key = key.lstrip("-")
        if key == "raise-on-rank":
            raise_on_rank = int(value)
        elif key == "reward-sleep":
            reward_sleep = float(value)
        elif key == "die-in-save":
            die_in_save = int(value)
        elif key == "flat-even":
            flat_even = bool(int(value))
        elif key == "lora-r":
            from peft import LoraConfig

            peft_config = LoraConfig(r=int(value), target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        elif key == "eval":
            evaluate = bool(int(value))
        elif key == "tools-every-turn" and int(value):
            from helpers import echo, register_test_formats

            register_test_formats()
            tools = [echo]
            options["tool_call_format"] = "test_every_turn"
        else:
            options[key] = coerce_option(key, value)
    rewards = [short]
    if flat_even:
        def short_or_flat(prompts, completions, **kwargs):
            scores = short(prompts, completions)
            return [1.0 if int(p.split("+")[0]) % 2 == 0 else s for p, s in zip(prompts, scores)]
        rewards = [short_or_flat]
    if raise_on_rank is not None:
        def fragile(prompts, completions, **kwargs):
            import os
            if int(os.environ.get("RANK", "0")) == raise_on_rank:
                raise ZeroDivisionError("boom on purpose")
            return [0.0] * len(completions)
        rewards.append(fragile)
    if reward_sleep:
        import os

        from slow_reward import slow

        os.environ["SLOW_REWARD_SECONDS"] = str(reward_sleep)
        rewards.append(slow)
    if die_in_save is not None:
        import os
        import signal

        import grpokit.train.checkpointer

        publish = grpokit.train.checkpointer.publish

        def publish_or_die(staging, output_dir, step, limit):
            if step == die_in_save:
                os.kill(os.getpid(), signal.SIGKILL)
            return publish(staging, output_dir, step, limit)

        grpokit.train.checkpointer.publish = publish_or_die
    dataset = datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)])
    eval_dataset = datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(4)]) if evaluate else None
    trainer = GRPOTrainer(model_dir, rewards, GRPOConfig(**options), dataset, eval_dataset=eval_dataset, tools=tools,
                          peft_config=peft_config)
    trainer.train(resume_from_checkpoint=True if resume else None)  # the trainer closes the process group at exit


if __name__ == "__main__":
    main()

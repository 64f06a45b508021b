"""A training script built the way open-r1's src/open_r1/grpo.py is, with grpokit in TRL's place: a GRPOConfig
subclass with the script's own fields, TrlParser over (script arguments, config, ModelConfig), the process facts of
TrainingArguments read before the trainer exists, resume from the last checkpoint in output_dir, then the Trainer's
tail (metrics, state, model, model card, config, evaluation).

usage: open_r1_style_grpo.py --config recipe.yaml [--option value ...]
"""

import dataclasses
import logging
import os
import sys

import datasets
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed
from transformers.trainer_utils import get_last_checkpoint
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from grpokit import GRPOConfig, GRPOTrainer

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RecipeConfig(GRPOConfig):
    """open-r1's additions to the training arguments."""

    system_prompt: str | None = None
    chat_template: str | None = None
    benchmarks: list[str] = dataclasses.field(default_factory=list)
    callbacks: list[str] = dataclasses.field(default_factory=list)
    hub_model_revision: str | None = "main"
    wandb_project: str | None = None


@dataclasses.dataclass
class RecipeScriptArguments(ScriptArguments):
    reward_funcs: list[str] = dataclasses.field(default_factory=lambda: ["length"])
    dataset_prompt_column: str = "problem"


def length_reward(completions, **kwargs):
    return [-abs(6 - len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


def main(script_args, training_args, model_args):
    set_seed(training_args.seed)
    logging.basicConfig(format="%(levelname)s - %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.warning(f"Process rank: {training_args.local_rank}, device: {training_args.device}, "
                   f"n_gpu: {training_args.n_gpu} distributed training: {bool(training_args.local_rank != -1)}, "
                   f"16-bits training: {training_args.fp16}")
    last_checkpoint = get_last_checkpoint(training_args.output_dir) if os.path.isdir(training_args.output_dir) else None

    dataset = datasets.load_dataset(script_args.dataset_name)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    if training_args.chat_template is not None:
        tokenizer.chat_template = training_args.chat_template
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=model_args.dtype,
        use_cache=not training_args.gradient_checkpointing)

    def make_conversation(example, prompt_column=script_args.dataset_prompt_column):
        prompt = [{"role": "system", "content": training_args.system_prompt}] if training_args.system_prompt else []
        prompt.append({"role": "user", "content": example[prompt_column]})
        return {"prompt": prompt}

    dataset = dataset.map(make_conversation)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[length_reward], args=training_args,
        train_dataset=dataset[script_args.dataset_train_split],
        eval_dataset=dataset[script_args.dataset_test_split] if training_args.eval_strategy != "no" else None,
        peft_config=get_peft_config(model_args), processing_class=tokenizer)

    checkpoint = training_args.resume_from_checkpoint or last_checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(dataset[script_args.dataset_train_split])
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()

    trainer.model.generation_config.eos_token_id = tokenizer.eos_token_id
    trainer.save_model(training_args.output_dir)
    kwargs = {"dataset_name": script_args.dataset_name, "tags": ["open-r1"]}
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(**kwargs)
        trainer.model.config.use_cache = True
        trainer.model.config.save_pretrained(training_args.output_dir)
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(dataset[script_args.dataset_test_split])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
    print(f"resumed from: {checkpoint}")


if __name__ == "__main__":
    parser = TrlParser((RecipeScriptArguments, RecipeConfig, ModelConfig))
    main(*parser.parse_args_and_config())

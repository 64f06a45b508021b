"""transformers' Trainer methods and results that TRL's scripts use around train(), with their signatures and
meaning, mixed into GRPOTrainer (TrainerAPI):

    result = trainer.train()          # TrainResult: TRL's TrainOutput(global_step, training_loss, metrics), which
                                      # also reads as the TrainerState (result.log_history, result.interrupted)
    trainer.log_metrics("train", result.metrics); trainer.save_metrics("train", result.metrics)
    trainer.save_state(); trainer.save_model(); trainer.create_model_card(); trainer.push_to_hub(); trainer.end()

and TRL's attributes and rules that a script relies on: `trainer.tools` (assignable), `hub_model_id`,
`is_world_process_zero()`, the iterable-dataset rules for accelerator_config and dataloader_num_workers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers.trainer_pt_utils import log_metrics, save_metrics
from transformers.trainer_utils import TrainOutput

from grpokit.algorithms import entropy_quantile_threshold, off_policy_mask
from grpokit.config import ConfigError, GRPOConfig
from grpokit.distributed import close_process_group
from grpokit.errors import write_text
from grpokit.train.hub import push_model
from grpokit.models.loading import context_length
from grpokit.tools import Toolbox
from grpokit.train.comm import Comm
from grpokit.train.setup import (Agent, Setup, check_context, episode_loop, eval_label, model_init_kwargs,
                                 prompt_images, tokenize_prompts)

logger = logging.getLogger("grpokit")


class TrainResult(TrainOutput):
    """What train() returns: transformers' TrainOutput(global_step, training_loss, metrics), as TRL's train()
    does (metrics: train_loss, train_runtime, train_samples_per_second, train_steps_per_second, epoch), that also
    reads as the trainer's TrainerState, which grpokit's train() returned before: result.log_history,
    result.interrupted, result.max_steps, ... (`result.state` is the state itself)."""

    def __new__(cls, state: Any, training_loss: float, metrics: dict[str, float]) -> "TrainResult":
        result = super().__new__(cls, state.global_step, training_loss, metrics)
        result.state = state
        return result

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state")
        if state is None:
            raise AttributeError(name)
        return getattr(state, name)

    def __reduce__(self):
        return TrainResult, (self.state, self.training_loss, self.metrics)


class TrainerAPI:
    """transformers Trainer's methods after training, for GRPOTrainer (which has args, state, comm, accelerator,
    setup, learner and checkpointer)."""

    log_metrics = log_metrics  # transformers' own: "***** train metrics *****" on process 0
    save_metrics = save_metrics  # transformers' own: OUTPUT_DIR/<split>_results.json and all_results.json

    def is_world_process_zero(self) -> bool:
        return self.comm.is_main

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model and tokenizer into `output_dir` (default: args.output_dir), atomically, on every process's
        call (process 0 writes)."""
        with self.learner.gathered():  # FSDP: every process gathers the weights onto process 0
            self.checkpointer.save_model(output_dir or self.args.output_dir, self._write_model)

    def save_state(self) -> None:
        """OUTPUT_DIR/trainer_state.json: the TrainerState, log_history included (transformers' save_state)."""
        if self.is_world_process_zero():
            write_text(Path(self.args.output_dir) / "trainer_state.json",
                       json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n",
                       "Writing the trainer state", "An earlier trainer_state.json there is unchanged.")

    @property
    def hub_model_id(self) -> str:
        """Where push_to_hub publishes: args.hub_model_id, else output_dir's folder name (a Hub repository of your
        account)."""
        return self.args.hub_model_id or Path(self.args.output_dir).resolve().name

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """OUTPUT_DIR/README.md: a model card naming the base model (when it is a hub name), the dataset and the
        tags (TRL's create_model_card), on process 0."""
        if self.is_world_process_zero():
            Path(self.args.output_dir, "README.md").write_text(
                model_card(self.learner.unwrapped, model_name or Path(self.args.output_dir).name, dataset_name, tags,
                           self.state))

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> str | None:
        """Save the model and a model card (kwargs: create_model_card's) to output_dir and publish its files to
        hub_model_id, as transformers' push_to_hub: a local folder (/, ./, ../, ~ or file://) gets a copy, anything
        else is a Hub repository, created if missing. Returns where the model went (process 0; None elsewhere).
        A failed push raises, as in transformers (the push at the end of train() only logs). The push blocks, with
        grpokit's commit message, whatever commit_message and blocking say."""
        if token is not None or revision is not None:
            raise ConfigError("push_to_hub(token=..., revision=...): log in with `hf auth login` or set HF_TOKEN; "
                              "grpokit pushes to the main branch.")
        self.save_model()
        if not self.is_world_process_zero():
            return None
        self.create_model_card(**kwargs)
        self.state.pushed_to = push_model(self.args.output_dir, self.hub_model_id, self.args.hub_private_repo)
        return self.state.pushed_to

    def end(self) -> None:
        """The end of a script (transformers' Trainer.end): the trackers are already finished by train(); the
        process group is drained and destroyed (grpokit/distributed.py)."""
        close_process_group()

    # ------------------------------------------------------------------ TRL's methods
    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's method: True where a counted token's entropy is at or above the `threshold` quantile (0..1) of the
        counted tokens' entropies on every process. Shapes: entropies, mask (B, T) -> (B, T) bool."""
        counted = Comm(self.accelerator).concat(entropies[mask.bool()].float())  # TRL's tests mock the accelerator only
        if counted.numel() == 0:
            return torch.zeros_like(entropies, dtype=torch.bool)
        cut = entropy_quantile_threshold(counted, 1.0 - threshold).to(entropies.device)
        return (entropies >= cut) & mask.bool()

    @staticmethod
    def get_off_policy_mask(advantages: torch.Tensor, per_token_logps: torch.Tensor,
                            sampling_per_token_logps: torch.Tensor, mask: torch.Tensor,
                            off_policy_threshold: float) -> torch.Tensor:
        """TRL's method: DeepSeek-V3.2's off-policy sequence mask (grpokit.algorithms.off_policy_mask), 1 keeps
        a sequence. Shapes: advantages (B, 1), the rest (B, T) -> (B, 1)."""
        return off_policy_mask(advantages, per_token_logps, sampling_per_token_logps, mask,
                               off_policy_threshold).to(mask.dtype)

    # ------------------------------------------------------------------ tools
    @property
    def tools(self) -> list:
        """TRL's attribute: every tool the model may call, the standalone ones and each environment's methods."""
        by_name = dict(self.toolbox.functions)
        for methods in (self.environments.tools.values() if self.environments is not None else []):
            for method in methods:
                by_name.setdefault(method.__name__, method)
        return list(by_name.values())

    @tools.setter
    def tools(self, tools: Any) -> None:
        """Assignable as in TRL: the tools the model may call from the next generation on (None or [] for none),
        replacing every standalone tool (the config's `tools` too); an environment's methods stay. The prompts are
        rendered again with the new tool schemas."""
        setup = with_tools(self.setup, tools, self.learner.unwrapped)
        self._connect(setup)


def with_tools(setup: Setup, tools: Any, model: Any) -> Setup:
    """`setup` with `tools` as its standalone tools (an environment's own methods in `tools` are left to the
    environment): a new toolbox and episode loop, the prompts tokenized again with the new schemas."""
    args, old = setup.args, setup.agent
    methods = {m.__name__ for ms in (old.environments.tools.values() if old.environments else []) for m in ms}
    tools = [tools] if callable(tools) or isinstance(tools, str) else list(tools or [])
    mine = [t for t in tools if getattr(t, "__name__", None) not in methods]
    try:
        toolbox = Toolbox(mine, timeout=args.tool_timeout, isolation=args.tool_isolation)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"trainer.tools = ...: {exc}") from exc
    agent = Agent(toolbox, old.call_format, old.environments, old.environment_schemas, None)
    if mine or old.environments is not None:
        agent = dataclasses.replace(agent, multiturn=episode_loop(args, setup.tokenizer, agent, setup.train_dataset))
    images = None if setup.images is None else prompt_images(args, setup.images.processor, setup.tokenizer, agent)
    prompt_ids = tokenize_prompts(args, setup.tokenizer, agent, setup.train_dataset, images=images)
    eval_prompt_ids = {name: tokenize_prompts(args, setup.tokenizer, agent, ds, f" of {eval_label(name)}", images)
                       for name, ds in setup.eval_datasets.items()}
    all_prompts = prompt_ids + [p for ids in eval_prompt_ids.values() for p in ids]
    check_context(context_length(model, model_init_kwargs(args)), all_prompts, args)
    return dataclasses.replace(setup, agent=agent, prompt_ids=prompt_ids, eval_prompt_ids=eval_prompt_ids,
                               images=images)


def apply_dataset_rules(args: GRPOConfig, train_dataset: Any, eval_dataset: Any) -> None:
    """TRL's rules for streaming datasets, applied to `args` as TRL's trainer does: with an IterableDataset
    anywhere, accelerator_config.dispatch_batches is False (True is refused: grpokit reads a stream on every
    process, as TRL does with it False); an IterableDataset to train on sets dataloader_num_workers to 0."""
    evals = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
    if any(isinstance(ds, datasets.IterableDataset) for ds in [train_dataset, *evals]):
        if args.accelerator_config.dispatch_batches:
            raise ConfigError("Iterable datasets require `dispatch_batches=False`, but it is set to `True` in "
                              "`accelerator_config`: every process reads the stream itself. Please set it to `False` "
                              "(or leave it unset).")
        args.accelerator_config.dispatch_batches = False
    if isinstance(train_dataset, datasets.IterableDataset) and args.dataloader_num_workers != 0:
        logger.warning("Iterable datasets require `dataloader_num_workers=0` to preserve prompt grouping; overriding "
                       "the provided value (%s).", args.dataloader_num_workers)
        args.dataloader_num_workers = 0


def model_card(model: Any, model_name: str, dataset_name: str | None, tags: Any, state: Any) -> str:
    """A model card as TRL writes one: YAML metadata (base model, datasets, library, tags), then what was done."""
    base = getattr(getattr(model, "config", None), "_name_or_path", None)
    base = base if base and not os.path.isdir(base) else None
    tags = sorted({"grpo", "grpokit", "trl", *([tags] if isinstance(tags, str) else tags or [])})
    meta = [f"base_model: {base}"] if base else []
    meta += [f"datasets: {dataset_name}"] if dataset_name else []
    meta += [f"model_name: {model_name}", "library_name: transformers", "tags:", *[f"- {t}" for t in tags]]
    trained = f"a fine-tuned version of [{base}](https://huggingface.co/{base})" if base else "a model"
    data = f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else ""
    return ("---\n" + "\n".join(meta) + "\n---\n\n"
            f"# Model Card for {model_name}\n\nThis model is {trained}, trained{data} with GRPO "
            "([DeepSeekMath](https://huggingface.co/papers/2402.03300)) using grpokit, for "
            f"{state.global_step} optimizer steps.\n")


def refuse_unsupported(**given: Any) -> None:
    """TRL trainer arguments grpokit does not implement: refused when set, with what to do instead."""
    advice = {
        "quantization_config": "quantized (bitsandbytes) training needs CUDA and is not supported; load the model in "
                               "bf16 (bf16=True) or train a LoRA adapter (peft_config=...)",
        "rollout_func": "custom rollout functions are not supported yet; a custom rollout engine is (register "
                        "one with grpokit.rollout.register_rollout_engine, see docs/vllm.md)",
    }
    problems = [f"{name}: {advice[name]}." for name, value in given.items() if value is not None]
    if problems:
        raise ConfigError("GRPOTrainer got arguments grpokit does not support:\n  - " + "\n  - ".join(problems))

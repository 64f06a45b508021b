"""Everything built before the first step that is not a model: one frozen `Setup`, with every up-front error.

    setup = build_setup(args, num_processes, model, reward_funcs, train_dataset, eval_dataset, ...)

Order matters for users: every check that needs no model runs before a model loads (datasets, tools and
environments, rewards, the chat template, prompt lengths against max_prompt_length and the model's context).
Reward models load here (they are reward functions); the policy and the reference load in the learner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from accelerate.utils import set_seed

from grpokit.config import ConfigError, GRPOConfig
from grpokit.data import DataError, check_dataset, eval_sets, is_conversational, render_prompt, take_rows
from grpokit.imports import import_path
from grpokit.models.loading import (ModelError, config_context, is_peft_model, is_vision_language, load_tokenizer,
                                    model_config)
from grpokit.rewards import resolve_reward_funcs
from grpokit.rewards.registry import per_spec
from grpokit.rollout.environments import Environments
from grpokit.rollout.multiturn import MultiTurn
from grpokit.tools import Toolbox, resolve_format
from grpokit.train.images import PromptImages, encode_row, vision_processor


@dataclass(frozen=True)
class Rewards:
    """The reward functions (an environment's get_reward included), their weights (F,) and metric names, the
    tokenizer of each reward model (None where a function needs none) and the compute_metrics functions."""

    funcs: list
    weights: torch.Tensor
    names: list[str]
    processing_classes: list
    metric_funcs: list


@dataclass(frozen=True)
class Agent:
    """Tools and environments: the toolbox, the call format, the environments (None without), each environment's
    method schemas, and the episode loop (None when nothing can be called: single-turn rollouts)."""

    toolbox: Toolbox
    call_format: Any
    environments: Environments | None
    environment_schemas: dict[str, list]
    multiturn: MultiTurn | None

    @property
    def agentic(self) -> bool:
        return self.multiturn is not None


@dataclass(frozen=True)
class Geometry:
    """How generation batches feed optimizer steps, per process, in TRL's order.

    micro_batches_per_generation: micro-batches of per_device_train_batch_size in one generation batch
    (steps_per_generation); uses_per_generation: the micro-batches trained on per generation batch (each of them
    once per num_iterations pass); micro_batches_per_step: gradient_accumulation_steps, taken in turn, so a step
    may end in the next generation batch (pipeline.ExperienceBuffer); reuses_batch: some batch is trained on after
    an optimizer step moved the weights, so old log-probs are needed: unless every generation batch is used up
    inside one step (gradient_accumulation_steps a multiple of uses_per_generation), TRL's rule."""

    num_processes: int
    micro_batches_per_generation: int
    uses_per_generation: int
    micro_batches_per_step: int
    reuses_batch: bool
    completions_per_generation: int  # on all processes together

    def generations_for(self, steps: int) -> int:
        """Generation batches that `steps` optimizer steps draw micro-batches from."""
        return math.ceil(steps * self.micro_batches_per_step / self.uses_per_generation)


@dataclass(frozen=True)
class Setup:
    """The run's data, rewards, tools and tokenizer, checked; `placeholder_prompts`: the environment owns the
    data and reset() writes each prompt (its dataset rows hold empty chat prompts)."""

    args: GRPOConfig
    geometry: Geometry
    tokenizer: Any
    train_dataset: datasets.Dataset
    placeholder_prompts: bool
    eval_datasets: dict[str | None, datasets.Dataset]
    prompt_ids: list[list[int]]
    eval_prompt_ids: dict[str | None, list[list[int]]]
    rewards: Rewards
    agent: Agent
    max_steps: int
    images: PromptImages | None = None  # a vision-language run: each drawn row's images (train/images.py)
    vision_language: bool = False  # the policy is a vision-language model (parts of it may get no gradient)

    def template_kwargs(self, environment: str | None = None) -> dict[str, Any]:
        return template_kwargs(self.args, self.agent, environment)

    def tokenize(self, dataset, where: str = "") -> list[list[int]]:
        return tokenize_prompts(self.args, self.tokenizer, self.agent, dataset, where, self.images)

    def visions(self, dataset, rows: list[int], where: str = "train_dataset") -> list | None:
        """Each row's prompt images (grpokit.vision.PromptVision or None), or None on a text run."""
        return None if self.images is None else self.images.of(dataset, rows, where)


def build_setup(args: GRPOConfig, num_processes: int, model: Any, reward_funcs: Any, train_dataset, eval_dataset,
                processing_class, reward_processing_classes, tools, environment_factory, compute_metrics,
                peft_config, device: str) -> Setup:
    """Every check and value of the run that needs no model, in the order that fails fastest."""
    geometry = build_geometry(args, num_processes)
    if environment_factory is not None and args.environment_factory is not None:
        raise ConfigError("environment_factory is given both to GRPOTrainer and in the config; give it once.")
    if args.environment_factory is not None:
        environment_factory = import_path(args.environment_factory, "environment_factory")
    train_dataset, placeholder = train_rows(args, geometry, train_dataset, environment_factory)
    eval_datasets = eval_rows(eval_dataset)
    config = model_config(model, model_init_kwargs(args))  # config only: cheap, read once
    toolbox, call_format, environments, schemas, agentic = agent_parts(
        args, tools, environment_factory, [train_dataset, *eval_datasets.values()])
    processor = vision_processor(args, config, model, processing_class, [train_dataset, *eval_datasets.values()])
    rewards = resolve_rewards(args, reward_funcs, reward_processing_classes, compute_metrics, environments, device)
    set_seed(args.seed)  # after the reward models, before the policy, as always
    if (args.eval_strategy != "no" or args.eval_on_start or compute_metrics is not None) and not eval_datasets:
        raise ConfigError(
            "eval_strategy, eval_on_start and compute_metrics need an eval_dataset; pass eval_dataset=... to "
            "GRPOTrainer (or eval_dataset: in the YAML)."
        )
    if is_peft_model(model) and peft_config is not None:
        raise ConfigError(
            "model is already a PeftModel and peft_config is given too: pass the PeftModel alone (its adapter "
            "trains), or the base model with peft_config."
        )
    tokenizer = load_tokenizer(model, processor or processing_class, args.trust_remote_code)
    agent = Agent(toolbox, call_format, environments, schemas, None)
    if agentic:
        agent = Agent(toolbox, call_format, environments, schemas,
                      episode_loop(args, tokenizer, agent, train_dataset))  # checks the chat template
    images = prompt_images(args, processor, tokenizer, agent)
    prompt_ids = tokenize_prompts(args, tokenizer, agent, train_dataset, images=images)
    eval_prompt_ids = {name: tokenize_prompts(args, tokenizer, agent, ds, f" of {eval_label(name)}", images)
                       for name, ds in eval_datasets.items()}
    all_prompts = prompt_ids + [p for ids in eval_prompt_ids.values() for p in ids]
    check_context(config_context(config), all_prompts, args)
    return Setup(args, geometry, tokenizer, train_dataset, placeholder, eval_datasets, prompt_ids, eval_prompt_ids,
                 rewards, agent, total_steps(args, geometry, len(train_dataset)), images, is_vision_language(config))


def prompt_images(args: GRPOConfig, processor, tokenizer, agent: Agent) -> PromptImages | None:
    """A vision-language run's encoder of drawn rows (each row's environment's tool schemas in its template)."""
    if processor is None:
        return None
    return PromptImages(processor, tokenizer, lambda environment: template_kwargs(args, agent, environment))


def build_geometry(args: GRPOConfig, num_processes: int) -> Geometry:
    args.check_geometry(num_processes)
    micro = args.resolved_steps_per_generation(num_processes)
    uses = micro * args.num_iterations
    return Geometry(
        num_processes=num_processes, micro_batches_per_generation=micro, uses_per_generation=uses,
        micro_batches_per_step=args.gradient_accumulation_steps,
        reuses_batch=args.gradient_accumulation_steps % uses != 0,
        completions_per_generation=args.global_generation_batch_size(num_processes),
    )


def total_steps(args: GRPOConfig, geometry: Geometry, rows: int) -> int:
    """max_steps, or the optimizer steps num_train_epochs of `rows` prompts take: the last one takes the
    micro-batches left when they are fewer than gradient_accumulation_steps (TRL's last step of an epoch)."""
    micro_batches = epoch_micro_batches(args, geometry, rows)
    if micro_batches is None:
        return args.max_steps
    return max(1, math.ceil(micro_batches / geometry.micro_batches_per_step))


def epoch_micro_batches(args: GRPOConfig, geometry: Geometry, rows: int) -> int | None:
    """The micro-batches a num_train_epochs run of `rows` prompts trains on (None when max_steps is set)."""
    if args.max_steps > 0:
        return None
    prompts_per_generation = geometry.completions_per_generation // args.num_generations
    generations = math.ceil(args.num_train_epochs * rows / prompts_per_generation)
    return generations * geometry.uses_per_generation


def model_init_kwargs(args: GRPOConfig) -> dict[str, Any]:
    kwargs = dict(args.model_init_kwargs)
    if args.trust_remote_code:
        kwargs.setdefault("trust_remote_code", True)
    return kwargs


def train_rows(args: GRPOConfig, geometry: Geometry, train_dataset, environment_factory):
    """train_dataset, checked, and whether its prompts are placeholders; a streaming one read up to the rows
    max_steps consumes (needs max_steps). With an environment_factory the environment may own the data (TRL): no
    dataset, or no 'prompt' column, and reset() supplies the prompt, appended to an empty user message."""
    placeholder = False
    if train_dataset is None and environment_factory is not None:
        train_dataset, placeholder = placeholder_rows(args, geometry, environment_factory), True
    if train_dataset is None:
        raise ConfigError("`train_dataset` is required: a datasets.Dataset (or IterableDataset) with a 'prompt' "
                          "column, e.g. Dataset.from_list([{'prompt': ...}, ...]), unless an "
                          "environment_factory owns the data.")
    if (environment_factory is not None and isinstance(train_dataset, datasets.Dataset)
            and "prompt" not in train_dataset.column_names):
        placeholder = True
        train_dataset = train_dataset.add_column("prompt", [[{"role": "user", "content": ""}]] * len(train_dataset))
    if isinstance(train_dataset, datasets.IterableDataset):
        if args.max_steps <= 0:
            raise ConfigError(
                "train_dataset is an IterableDataset (streaming), which has no length to count epochs by: set "
                "max_steps (e.g. max_steps=1000) instead of num_train_epochs."
            )
        prompts = geometry.completions_per_generation // args.num_generations
        generations = geometry.generations_for(args.max_steps)
        train_dataset = take_rows(train_dataset, prompts * generations)
    check_dataset(train_dataset)
    return train_dataset, placeholder


def placeholder_rows(args: GRPOConfig, geometry: Geometry, environment_factory) -> datasets.Dataset:
    """No train_dataset: one generation batch of empty chat prompts, which reset() fills; max_steps sets the
    length (TRL's rule)."""
    if isinstance(environment_factory, dict):
        raise ConfigError("A dict environment_factory (several environments) requires a `train_dataset` with an "
                          "'environment' column to route each row to its environment; give a dataset, or a single "
                          "factory.")
    if args.max_steps <= 0:
        raise ConfigError("Without a train_dataset (the environment owns the data and reset() returns the prompt), "
                          "max_steps must be set to a positive number: it is the training length.")
    rows = geometry.completions_per_generation // args.num_generations
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": ""}]] * rows})


def eval_rows(eval_dataset) -> dict[str | None, datasets.Dataset]:
    """eval_dataset as checked {name: Dataset} (see grpokit.data.eval_sets); a streaming set is read whole."""
    sets = {name: take_rows(ds, None, eval_label(name)) if isinstance(ds, datasets.IterableDataset) else ds
            for name, ds in eval_sets(eval_dataset).items()}
    for name, ds in sets.items():
        check_dataset(ds, eval_label(name))
    return sets


def eval_label(name: str | None) -> str:
    """How errors name an eval set."""
    return "eval_dataset" if name is None else f"eval_dataset[{name!r}]"


def agent_parts(args: GRPOConfig, tools, environment_factory, datasets_: list):
    """The toolbox (tools= plus the config's `tools`), the call format, the environments (rows of every dataset
    checked against them), each environment's method schemas, and whether rollouts are episodes (any tool or
    environment); all checked before anything loads."""
    specs = ([tools] if callable(tools) or isinstance(tools, str) else list(tools or [])) + list(args.tools)
    try:
        toolbox = Toolbox(specs, timeout=args.tool_timeout, isolation=args.tool_isolation)
        call_format = resolve_format(args.tool_call_format)
        environments = Environments(environment_factory) if environment_factory is not None else None
        schemas = {}
        if environments is not None:
            for dataset in datasets_:
                environments.check_rows(dataset)
            schemas = {name: Toolbox([]).with_methods(methods).schemas
                       for name, methods in environments.tools.items()}
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc)) from exc
    return toolbox, call_format, environments, schemas, bool(specs) or environments is not None


def episode_loop(args: GRPOConfig, tokenizer, agent: Agent, train_dataset) -> MultiTurn:
    """The episode loop; conversational prompts get the tool schemas in their chat template (each environment's
    own methods added for its rows)."""
    conversational = is_conversational(train_dataset[0]["prompt"])
    try:
        first_environment = next(iter(agent.environment_schemas), None)
        with_tools = bool(agent.toolbox.schemas) or any(agent.environment_schemas.values())
        return MultiTurn(tokenizer, agent.toolbox, agent.call_format, [tokenizer.eos_token_id], conversational,
                         args.max_tool_calling_iterations, template_kwargs(args, agent, first_environment, True),
                         with_tools)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def template_kwargs(args: GRPOConfig, agent: Agent, environment: str | None = None,
                    agentic: bool | None = None) -> dict[str, Any]:
    """chat_template_kwargs, plus the tool schemas the model may call (those of the row's environment too)."""
    kwargs = dict(args.chat_template_kwargs or {})
    agentic = agent.agentic if agentic is None else agentic
    schemas = agent.toolbox.schemas + agent.environment_schemas.get(environment, []) if agentic else []
    if schemas:
        kwargs["tools"] = schemas
    return kwargs


def resolve_rewards(args: GRPOConfig, reward_funcs, reward_processing_classes, compute_metrics, environments,
                    device: str) -> Rewards:
    """The reward functions, their weights and names, the tokenizer of each reward model
    (reward_processing_classes, None where the function loads its own or needs none), and the compute_metrics
    functions."""
    reward_model_kwargs = {"device": device, **args.reward_model_kwargs}
    specs = [] if reward_funcs is None else reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    environment_rewards = environments.reward_functions() if environments is not None else []
    if not specs and not environment_rewards:
        raise ConfigError(
            "No reward source provided: pass reward_funcs (a function, a list of them, built-in names, import "
            "paths or reward models), or an environment_factory whose environments define get_reward(); "
            "without one every advantage would be 0 and nothing would be learned."
        )
    processing_classes = per_spec(reward_processing_classes, len(specs))
    funcs = resolve_reward_funcs(
        list(specs), reward_model_kwargs, max_completion_length=args.max_completion_length,
        processing_classes=processing_classes,
    ) if specs else []  # an environment's get_reward may be the only reward (added below)
    weights = args.reward_weights or [1.0] * len(funcs)
    if len(weights) != len(funcs):
        raise ConfigError(
            f"reward_weights has {len(weights)} entries but there are {len(funcs)} reward functions; "
            "give one weight per function, in order."
        )
    if environment_rewards:  # each environment class with get_reward: one more function, weight 1 (TRL)
        funcs += resolve_reward_funcs(environment_rewards, reward_model_kwargs)
        weights = list(weights) + [1.0] * len(environment_rewards)
    metric_funcs = []
    if compute_metrics is not None:  # reward-contract functions scored on eval completions only
        metric_specs = compute_metrics if isinstance(compute_metrics, (list, tuple)) else [compute_metrics]
        metric_funcs = resolve_reward_funcs(list(metric_specs), reward_model_kwargs,
                                            max_completion_length=args.max_completion_length)
    return Rewards(funcs, torch.tensor(weights, dtype=torch.float32), [f.name for f in funcs], processing_classes,
                   metric_funcs)


def tokenize_prompts(args: GRPOConfig, tokenizer, agent: Agent, dataset, where: str = "",
                     images: PromptImages | None = None) -> list[list[int]]:
    """Token ids of every prompt, checked before any model loads; `where` names the dataset in errors. With
    images (a vision-language run), each row through the processor, its images decoded and counted."""
    if images is not None:
        label = where.removeprefix(" of ") or "train_dataset"
        ids = [encode_row(images.processor, tokenizer, dataset, row, f"{label} row {row}", images.kwargs_for)[0]
               for row in range(len(dataset))]
        return check_prompt_lengths(ids, args.max_prompt_length, where)
    environments = environment_names(agent, dataset)
    try:
        texts = [render_prompt(tokenizer, p, template_kwargs(args, agent, e))
                 for p, e in zip(dataset["prompt"], environments)]
    except DataError:
        raise
    except Exception as exc:  # a chat template that fails on these prompts (or on tools=...)
        raise ConfigError(f"The chat template failed to render the prompts{where}: {type(exc).__name__}: "
                          f"{exc}") from exc
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return check_prompt_lengths(ids, args.max_prompt_length, where)


def check_prompt_lengths(ids: list[list[int]], limit: int | None, where: str) -> list[list[int]]:
    """Every prompt non-empty and within max_prompt_length (image tokens count)."""
    for row, seq in enumerate(ids):
        if not seq:
            raise ConfigError(f"Prompt at row {row}{where} is empty after tokenisation; remove it from the dataset.")
        if limit is not None and len(seq) > limit:
            raise ConfigError(
                f"Prompt at row {row}{where} has {len(seq)} tokens, more than max_prompt_length={limit}; raise "
                "max_prompt_length or filter long prompts (e.g. dataset.filter(...))."
            )
    return ids


def environment_names(agent: Agent, dataset) -> list[str | None]:
    """Each row's environment name (a dict environment_factory), else None."""
    if agent.environments is None or not agent.environments.named:
        return [None] * len(dataset)
    return agent.environments.resolve_names(dataset["environment"])


def check_context(context: int | None, prompt_ids: list[list[int]], args: GRPOConfig) -> None:
    longest = max(len(p) for p in prompt_ids)
    if context is not None and longest + args.max_completion_length > context:
        raise ModelError(
            f"The longest prompt ({longest} tokens) plus max_completion_length={args.max_completion_length} exceeds "
            f"the model's context of {context} tokens; shorten prompts or lower max_completion_length."
        )

"""The `grpo` command: `grpo train CONFIG.yaml [--option value ...]` and `grpo demo`.

The YAML holds `model`, `dataset`, `reward_funcs` (and optionally `eval_dataset`) beside any GRPOConfig option;
options given on the command line win. The help text of every option is the docstring under its GRPOConfig field.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from grpokit.config import ConfigError, GRPOConfig, coerce_option, field_docs, load_yaml

RUN_KEYS = {
    "model": "Model to train: a local folder written by save_pretrained, or a hub name.",
    "dataset": "Training prompts: a local .jsonl/.json/.csv/.parquet file or a datasets name; or a mapping "
    "{path, split, name}. Needs a 'prompt' column; other columns reach the reward functions.",
    "eval_dataset": "Optional held-out prompts, same forms as dataset; scored once after training.",
    "reward_funcs": "List of reward functions: import paths 'pkg.module:function', built-in names, reward-model "
    "paths or http(s) endpoints.",
}


def _train_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "train",
        help="Train with GRPO from a YAML config.",
        description="Train with GRPO. Options come from CONFIG (YAML) and are overridden by --option value.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="YAML file with model, dataset, reward_funcs and any option below.")
    parser.add_argument("--resume", action="store_true", help="Continue from the newest checkpoint in output_dir.")
    run = parser.add_argument_group("run")
    for key, text in RUN_KEYS.items():
        run.add_argument(f"--{key}", default=None, help=text)
    options = parser.add_argument_group("GRPOConfig options (defaults in brackets)")
    docs = field_docs()
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        names = [f"--{f.name}"] + ([f"--{f.name.replace('_', '-')}"] if "_" in f.name else [])
        options.add_argument(*names, dest=f.name, default=None, metavar="V", help=f"{docs.get(f.name, '')} [{default!r}]".replace("%", "%%"))
    return parser


def _demo_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("demo", help="Train a tiny model offline on CPU and show it learn (minutes).")
    parser.add_argument("--output-dir", default="outputs/demo", help="Where the model, curve and summary go.")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps (default: the tuned demo length).")
    parser.add_argument("--seed", type=int, default=0, help="Seed; the same seed gives the same numbers.")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO training for language models.")
    sub = parser.add_subparsers(dest="command", metavar="{train,demo}")
    _train_parser(sub)
    _demo_parser(sub)
    return parser


def merge_train_options(yaml_values: dict[str, Any], cli: argparse.Namespace) -> tuple[dict[str, Any], GRPOConfig]:
    """YAML values overridden by the command line -> (run keys, GRPOConfig)."""
    values = dict(yaml_values)
    for key in RUN_KEYS:
        if getattr(cli, key) is not None:
            values[key] = coerce_yaml_scalar(getattr(cli, key))
    for f in dataclasses.fields(GRPOConfig):
        given = getattr(cli, f.name)
        if given is not None:
            values[f.name] = coerce_option(f.name, given)
    run = {key: values.pop(key) for key in list(values) if key in RUN_KEYS}
    for key in ("model", "dataset", "reward_funcs"):
        if key not in run:
            raise ConfigError(f"The config needs '{key}': {RUN_KEYS[key]}")
    if not isinstance(run["reward_funcs"], list):
        run["reward_funcs"] = [run["reward_funcs"]]
    return run, GRPOConfig.from_dict(values)


def coerce_yaml_scalar(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def run_train(cli: argparse.Namespace) -> int:
    from grpokit.data import load_dataset_spec
    from grpokit.distributed import close_process_group
    from grpokit.trainer import GRPOTrainer

    run, config = merge_train_options(load_yaml(cli.config), cli)
    train = load_dataset_spec(run["dataset"])
    evaluation = load_dataset_spec(run["eval_dataset"]) if run.get("eval_dataset") else None
    trainer = GRPOTrainer(
        model=str(run["model"]), reward_funcs=run["reward_funcs"], args=config,
        train_dataset=train, eval_dataset=evaluation,
    )
    try:
        trainer.train(resume_from_checkpoint=True if cli.resume else None)
    finally:
        close_process_group()  # drained first, so the gloo teardown cannot deadlock (grpokit/distributed.py)
    return 0


def run_demo(cli: argparse.Namespace) -> int:
    from grpokit.demo.run import run_demo as demo

    demo(output_dir=cli.output_dir, steps=cli.steps, seed=cli.seed)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    cli = parser.parse_args(argv)
    if cli.command is None:
        parser.print_help()
        return 2
    from grpokit.data import DataError
    from grpokit.modeling import ModelError
    from grpokit.rewards import RewardError

    try:
        return {"train": run_train, "demo": run_demo}[cli.command](cli)
    except (ConfigError, DataError, ModelError, RewardError) as exc:  # user errors: the message says the fix
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # training diverged (NonFiniteError): the message says what to try
        from grpokit.trainer import NonFiniteError  # already imported by the run that raised

        if not isinstance(exc, NonFiniteError):
            raise
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

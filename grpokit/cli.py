"""The `grpo` command: `grpo train CONFIG.yaml [--option value ...]`, `grpo demo`, `grpo vllm-serve` and
`grpo report OUTPUT_DIR`.

The YAML holds `model`, `dataset`, `reward_funcs` (and optionally `eval_dataset`) beside any GRPOConfig option;
options given on the command line win. A TRL or open-r1 recipe's script keys (model_name_or_path, dataset_name,
torch_dtype, system_prompt, use_peft, ...) are read as those scripts read them (grpokit/recipe.py). The help text
of every option is the docstring under its GRPOConfig field.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

from grpokit.config import ConfigError, GRPOConfig, choices_help, coerce_option, field_docs, load_yaml
from grpokit.recipe import recipe_run

RUN_KEYS = {
    "model": "Model to train: a local folder written by save_pretrained, or a hub name.",
    "dataset": "Training prompts: a local .jsonl/.json/.csv/.parquet file or a datasets name; or a mapping "
    "{path, split, name}; or 'reasoning_gym:<task>[,<task>...]' (docs/tasks.md). Needs a 'prompt' column; other "
    "columns reach the reward functions.",
    "eval_dataset": "Optional held-out prompts, same forms as dataset; scored once after training.",
    "reward_funcs": "List of reward functions: import paths 'pkg.module:function', built-in names, reward-model "
    "paths or http(s) endpoints.",
}


COMMON_OPTIONS = ("output_dir", "max_steps", "learning_rate", "num_generations", "per_device_train_batch_size",
                  "max_completion_length", "beta", "use_vllm")
"""The options most runs set: the first screen of `grpo train --help` names them."""

TRAIN_USAGE = "grpo train [CONFIG.yaml] [--model M] [--dataset D] [--reward_funcs F] [--OPTION VALUE ...] [--resume]"


def _train_description() -> str:
    return (
        "Train with GRPO. Options come from CONFIG (YAML) and are overridden by --option value; without a YAML,\n"
        "--model, --dataset and --reward_funcs are enough:\n\n"
        "  grpo train examples/tiny_add.yaml --max_steps 60\n"
        "  grpo train --model Qwen/Qwen2.5-0.5B-Instruct --dataset prompts.jsonl --reward_funcs exact_match\n\n"
        f"Most runs set: {', '.join('--' + name for name in COMMON_OPTIONS[:4])},\n"
        f"  {', '.join('--' + name for name in COMMON_OPTIONS[4:])}.\n"
        f"All {len(dataclasses.fields(GRPOConfig))} options follow, each with its default "
        "(grpo train --help | less); TRL's names are accepted."
    )


def _train_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "train",
        help="Train with GRPO from a YAML config and/or --model, --dataset, --reward_funcs.",
        usage=TRAIN_USAGE,
        description=_train_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # --num_gen is a typo to report, not --num_generations
    )
    parser.add_argument("config", nargs="?", default=None,
                        help="YAML file with model, dataset, reward_funcs and any option below (optional).")
    parser.add_argument("--resume", action="store_true",
                        help="Continue from the newest checkpoint in output_dir (the one loaded is printed).")
    run = parser.add_argument_group("run")
    for key, text in RUN_KEYS.items():
        run.add_argument(f"--{key}", default=None, help=text)
    options = parser.add_argument_group("GRPOConfig options (defaults in brackets)")
    docs = field_docs()
    for f in dataclasses.fields(GRPOConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        text = f"{docs.get(f.name, '')}{choices_help(f.name)} [{default!r}]".replace("%", "%%")
        options.add_argument(*option_strings(f.name), dest=f.name, default=None, metavar="V", help=text)
    return parser


def option_strings(name: str) -> list[str]:
    """--name, and --na-me for a name with underscores."""
    return [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])


def train_value_options() -> set[str]:
    """The option strings of `grpo train` that take a value."""
    names = [*RUN_KEYS, *(f.name for f in dataclasses.fields(GRPOConfig))]
    return {s for name in names for s in option_strings(name)}


def _demo_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser("demo", help="Train a tiny model offline on CPU and show it learn (minutes).")
    parser.add_argument("--task", choices=("addition", "tools", "vision"), default="addition",
                        help="addition: learn to carry (docs/demo.md); tools: learn to call a calculator tool in "
                             "multi-turn episodes (docs/tools.md); vision: a tiny Qwen2.5-VL learns which shape's "
                             "colour was asked (docs/vision.md).")
    parser.add_argument("--output-dir", "--output_dir", default=None,  # grpo train's spelling works too
                        help="Where the model, curves and summary go (default: outputs/demo, outputs/demo-tools or "
                             "outputs/demo-vision).")
    parser.add_argument("--steps", type=int, default=None, help="Optimizer steps (default: the tuned demo length).")
    parser.add_argument("--seed", type=int, default=0, help="Seed; the same seed gives the same numbers.")
    parser.add_argument("--use-vllm", "--use_vllm", action="store_true",
                        help="Generate with vLLM (colocate) instead of the local engine.")
    parser.add_argument("--max-staleness", "--max_staleness", type=int, default=0, metavar="K",
                        help="Generate the next batches while this one trains, with weights up to K steps old "
                             "(asynchronous rollouts, docs/async.md) [0: synchronous].")
    return parser


def _serve_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "vllm-serve",
        help="Start a vLLM server that grpo train can use with vllm_mode: server.",
        description="Start vLLM's OpenAI-compatible server with what grpokit's server mode needs: the dev-mode "
        "endpoints that reload weights (VLLM_SERVER_DEV_MODE=1) and the sampler's processed log-probs. Arguments "
        "after the known ones go to vLLM unchanged (e.g. --max-num-seqs 64). The process becomes the server: "
        "stop it with Ctrl-C or SIGTERM.",
    )
    parser.add_argument("--model", required=True, help="Folder written by save_pretrained (with its tokenizer), or a hub name.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="Address to listen on [127.0.0.1: this machine only]. The server's endpoints load "
                        "weights from any path they are sent, so bind another address (0.0.0.0: every network) "
                        "only on a network you trust.")
    parser.add_argument("--port", type=int, default=8000, help="Port [8000] (vllm_server_port on the trainer side).")
    parser.add_argument("--dtype", default="auto", help="Weights dtype for vLLM [auto]; float32 to match an fp32 trainer.")
    parser.add_argument("--max-model-len", type=int, default=None, help="Longest prompt + completion to serve.")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None, help="GPU: fraction of its memory for vLLM.")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="CPU: GiB of RAM for the KV cache [1].")
    parser.add_argument("--dry-run", action="store_true", help="Print the command and environment, start nothing.")
    return parser


def _step_list(text: str) -> list[int]:
    try:
        steps = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated step numbers such as 10,50, got {text!r}") from None
    if not steps:
        raise argparse.ArgumentTypeError("expected at least one step number, such as 10,50")
    return steps


def _report_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "report",
        help="Write OUTPUT_DIR/report.html: curves, run-health alarms, best and worst completions.",
        description="Write one self-contained HTML page (no network access) about a run from its metrics.jsonl and "
        "completions.jsonl: a chart per metric group, the run-health alarms with their evidence, and the best and "
        "worst completions of chosen steps. Prints the path it wrote. docs/report.md describes the page.",
    )
    parser.add_argument("output_dir", help="The run's output_dir (holds metrics.jsonl).")
    parser.add_argument("--steps", type=_step_list, default=None,
                        help="Steps whose best and worst completions to show, e.g. 10,50 [first, middle, last logged].")
    parser.add_argument("--output", default=None, help="Where to write the page [OUTPUT_DIR/report.html].")
    return parser


def _export_parser(sub) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "export",
        help="Write a checkpoint's model as a Hugging Face folder (consolidating FSDP2 shards).",
        description="Write the model of CHECKPOINT (a checkpoint-<step> folder) into OUT, a folder that "
        "from_pretrained loads: a sharded (FSDP2) checkpoint is consolidated, each tensor read whole from every "
        "process's shards, on one process and without a GPU; a checkpoint written whole is copied. The checkpoint "
        "is verified against its manifest first; OUT must be new or empty. A PEFT checkpoint gives the adapter "
        "(adapter_config.json names its base model). docs/distributed.md describes the checkpoint layout.",
    )
    parser.add_argument("checkpoint", help="The checkpoint folder, e.g. outputs/run/checkpoint-500.")
    parser.add_argument("out", help="The folder to write (created; must not hold files).")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO training for language models.")
    sub = parser.add_subparsers(dest="command", metavar="{train,demo,vllm-serve,report,export}")
    _train_parser(sub)
    _demo_parser(sub)
    _serve_parser(sub)
    _report_parser(sub)
    _export_parser(sub)
    return parser


def split_unknown_options(args: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], dict[str, str]]:
    """`grpo train`'s arguments -> (what argparse reads, {name: value} of the options it does not know: TRL's, or
    typos, which GRPOConfig.from_dict judges). Split before argparse so that an unknown option's value is never
    read as the CONFIG positional (`--use_liger_kernel true` is not a YAML file named "true")."""
    known_with_value, kept, unknown, i = train_value_options(), [], {}, 0
    while i < len(args):
        item = args[i]
        name, equals, value = item.partition("=")
        if not item.startswith("--") or len(item) < 3 or name in ("--resume", "--help"):
            kept.append(item)
        elif name in known_with_value:
            kept.extend(args[i : i + (1 if equals else 2)])
            i += 0 if equals else 1
        else:
            if not equals:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    parser.error(f"{item} needs a value (e.g. {item} true)")
                value, i = args[i + 1], i + 1
            unknown[name[2:].replace("-", "_")] = value
        i += 1
    return kept, unknown


def merge_train_options(yaml_values: dict[str, Any], cli: argparse.Namespace) -> tuple[dict[str, Any], GRPOConfig]:
    """YAML values overridden by the command line -> (run keys, GRPOConfig)."""
    values = dict(yaml_values)
    for key, text in getattr(cli, "extra_options", {}).items():
        values[key] = coerce_yaml_scalar(text)
    for key in RUN_KEYS:
        if getattr(cli, key) is not None:
            values[key] = coerce_yaml_scalar(getattr(cli, key))
    for f in dataclasses.fields(GRPOConfig):
        given = getattr(cli, f.name)
        if given is not None:
            values[f.name] = coerce_option(f.name, given)
    values, recipe = recipe_run(values)  # TRL / open-r1 script keys (grpokit/recipe.py)
    run = {key: values.pop(key) for key in list(values) if key in RUN_KEYS}
    run["recipe"] = recipe
    missing = [key for key in ("model", "dataset", "reward_funcs") if key not in run]
    if missing and getattr(cli, "config", None) is None:
        raise ConfigError("give a YAML config, or --model, --dataset and --reward_funcs (missing: "
                          f"{', '.join('--' + key for key in missing)}); see grpo train --help.")
    if missing:
        raise ConfigError(f"The config needs '{missing[0]}' (in the YAML or --{missing[0]}): {RUN_KEYS[missing[0]]}")
    if not isinstance(run["reward_funcs"], list):
        run["reward_funcs"] = [run["reward_funcs"]]
    return run, GRPOConfig.from_dict(values)


def coerce_yaml_scalar(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def run_train(cli: argparse.Namespace) -> int:
    from grpokit.data import load_dataset_spec
    from grpokit.distributed import close_process_group
    from grpokit.models.loading import load_tokenizer
    from grpokit.recipe import peft_config as recipe_peft_config
    from grpokit.recipe import prepare_dataset
    from grpokit.train.trainer import GRPOTrainer

    run, config = merge_train_options(load_yaml(cli.config) if cli.config else {}, cli)
    recipe = run["recipe"]
    lora = recipe_peft_config(recipe)
    train = prepare_dataset(load_dataset_spec(run["dataset"]), recipe)
    evaluation = prepare_dataset(load_dataset_spec(run["eval_dataset"]), recipe) if run.get("eval_dataset") else None
    tokenizer = None
    if recipe.get("chat_template"):
        tokenizer = load_tokenizer(str(run["model"]), trust_remote_code=config.trust_remote_code)
        tokenizer.chat_template = recipe["chat_template"]
    trainer = GRPOTrainer(
        model=str(run["model"]), reward_funcs=run["reward_funcs"], args=config,
        train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer, peft_config=lora,
    )
    started = time.perf_counter()
    try:
        state = trainer.train(resume_from_checkpoint=True if cli.resume else config.resume_from_checkpoint)
    finally:
        close_process_group()  # drained first, so the gloo teardown cannot deadlock (grpokit/distributed.py)
    if trainer.accelerator.is_main_process:
        print(run_summary(state, config, resume_command(cli), time.perf_counter() - started), file=sys.stderr,
              flush=True)
    return 0


def resume_command(cli: argparse.Namespace) -> str:
    """The command that continues this run: the same arguments with --resume."""
    import shlex

    args = [a for a in getattr(cli, "argv", None) or ["train", cli.config or "..."] if a != "--resume"]
    return shlex.join(["grpo", *args, "--resume"])


def run_summary(state, config: GRPOConfig, resume: str, seconds: float) -> str:
    """What the run did, in a few lines: steps, time, first and last logged reward, eval, where things are."""
    train_rows = [row for row in state.log_history if "reward" in row]
    eval_rows = [row for row in state.log_history if "eval/reward" in row]
    lines = [f"grpo train: {'stopped' if state.interrupted else 'finished'} at step {state.global_step} of "
             f"{state.max_steps} in {seconds:.0f} s (epoch {state.epoch:.2f})."]
    if train_rows:
        lines.append(f"  reward: {train_rows[0]['reward']:.4f} at step {train_rows[0]['step']} -> "
                     f"{train_rows[-1]['reward']:.4f} at step {train_rows[-1]['step']}")
    if eval_rows:
        lines.append(f"  eval/reward: {eval_rows[-1]['eval/reward']:.4f} at step {eval_rows[-1]['step']}")
    if state.best_model_checkpoint:
        lines.append(f"  best model ({config.metric_for_best_model or 'eval/reward'} = {state.best_metric:.4f}): "
                     f"{state.best_model_checkpoint}")
    if config.push_to_hub:
        lines.append(f"  pushed to: {state.pushed_to}" if state.pushed_to else
                     "  push_to_hub FAILED (see the error above); the model is in output_dir")
    if state.interrupted:
        lines.append(f"  interrupted by {state.interrupted}; a checkpoint was saved. Continue with: "
                     f"{resume}")
    else:
        lines.append(f"  model: {config.output_dir}")
    lines.append(f"  metrics: {config.output_dir}/metrics.jsonl; report: grpo report {config.output_dir}")
    return "\n".join(lines)


class _StderrHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (a test's capture included), as logging's last-resort handler."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(_CliFormatter())

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ sets it; the property always answers sys.stderr
        pass


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"grpokit: {level}{super().format(record)}"


@contextlib.contextmanager
def shown_logs():
    """Inside: grpokit's INFO lines (the checkpoint a resume loaded, a push to the Hub, a callback's stop) and its
    warnings on stderr; without this, Python prints warnings only. The logger is as it was afterwards."""
    log = logging.getLogger("grpokit")
    handler, level = _StderrHandler(), log.level
    log.addHandler(handler)
    if level == logging.NOTSET or level > logging.INFO:
        log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def run_demo(cli: argparse.Namespace) -> int:
    if cli.task == "vision":
        if cli.use_vllm or cli.max_staleness:
            print("grpo demo --task vision runs with the local engine, synchronously: drop --use-vllm and "
                  "--max-staleness (vLLM with images is not supported yet).", file=sys.stderr)
            return 2
        from grpokit.demo.vision_run import run_vision_demo

        run_vision_demo(output_dir=cli.output_dir or "outputs/demo-vision", steps=cli.steps, seed=cli.seed)
        return 0
    if cli.task == "tools":
        from grpokit.demo.tools_run import run_tools_demo

        run_tools_demo(output_dir=cli.output_dir or "outputs/demo-tools", steps=cli.steps, seed=cli.seed,
                       use_vllm=cli.use_vllm, max_staleness=cli.max_staleness)
        return 0
    from grpokit.demo.run import run_demo as demo

    demo(output_dir=cli.output_dir or "outputs/demo", steps=cli.steps, seed=cli.seed, use_vllm=cli.use_vllm,
         max_staleness=cli.max_staleness)
    return 0


def run_report(cli: argparse.Namespace) -> int:
    from grpokit.errors import SaveError
    from grpokit.observe.report import ReportError, write_report

    try:
        path = write_report(cli.output_dir, steps=cli.steps, output=cli.output)
    except ReportError as exc:
        print(f"grpo report: error: {exc}", file=sys.stderr)
        return 2
    except SaveError as exc:  # the page could not be written: the message names the path and the free space
        print(f"grpo report: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def run_export(cli: argparse.Namespace) -> int:
    from grpokit.train.distcp import export_checkpoint

    print(export_checkpoint(Path(cli.checkpoint), Path(cli.out)))
    return 0


def vllm_serve_command(cli: argparse.Namespace, extra: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start vLLM's server for grpokit's server mode."""
    import os

    import torch

    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cli.model), "--host", cli.host,
        "--port", str(cli.port), "--dtype", cli.dtype, "--logprobs-mode", "processed_logprobs",
    ]
    if cli.max_model_len is not None:
        argv += ["--max-model-len", str(cli.max_model_len)]
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    if torch.cuda.is_available():
        if cli.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(cli.gpu_memory_utilization)]
    else:  # on CPU the default fraction of RAM refuses to start; a fixed KV-cache size does
        if not any(a.startswith("--kv-cache-memory-bytes") for a in extra) and "VLLM_CPU_KVCACHE_SPACE" not in env:
            argv += ["--kv-cache-memory-bytes", str(int(cli.kv_cache_gib * 2**30))]
        argv.append("--enforce-eager")
    return argv + extra, env


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_vllm_serve(cli: argparse.Namespace, extra: list[str]) -> int:
    import importlib.util
    import os

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError('grpo vllm-serve needs vLLM: pip install -e ".[vllm]" (or bash scripts/setup.sh dev,vllm).')
    argv, env = vllm_serve_command(cli, extra)
    if not is_loopback(cli.host):
        print(f"grpo vllm-serve: warning: listening on {cli.host}: every machine that reaches port {cli.port} can "
              "generate and replace the model's weights (the reload endpoints are on). Use --host 127.0.0.1 unless "
              "the trainer runs on another machine of a network you trust.", file=sys.stderr, flush=True)
    if cli.dry_run:
        print(" ".join(argv))
        print(f"VLLM_SERVER_DEV_MODE={env['VLLM_SERVER_DEV_MODE']}")
        return 0
    sys.stdout.flush()
    os.execve(argv[0], argv, env)  # the server replaces this process: its signals and exit code are the server's
    return 1  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    unknown: dict[str, str] = {}
    if args[:1] == ["train"]:  # --name value pairs that are not grpokit options: TRL's, or typos
        args, unknown = split_unknown_options(args, parser)
    cli, extra = parser.parse_known_args(args)
    cli.extra_options, cli.argv = unknown, list(sys.argv[1:] if argv is None else argv)
    if extra and cli.command != "vllm-serve":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if cli.command == "vllm-serve":
        try:
            return run_vllm_serve(cli, extra)
        except ConfigError as exc:
            print(f"grpo vllm-serve: error: {exc}", file=sys.stderr)
            return 2
    if cli.command is None:
        parser.print_help()
        return 2
    if cli.command == "report":  # reads files only: none of the training imports below
        return run_report(cli)
    from grpokit.errors import CheckpointError
    from grpokit.data import DataError
    from grpokit.models.loading import ModelError
    from grpokit.rewards import RewardError
    from grpokit.rollout.engine import RolloutEngineError
    from grpokit.rollout.environments import EnvironmentContractError

    try:
        with shown_logs():
            return {"train": run_train, "demo": run_demo, "export": run_export}[cli.command](cli)
    except (ConfigError, DataError, ModelError, RewardError, CheckpointError,
            EnvironmentContractError) as exc:  # the message says the fix (user code's: the function and the row)
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a save failed (SaveError names the path and the free space)
        from grpokit.train.checkpointer import SaveError

        if not isinstance(exc, SaveError):
            raise
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 1
    except RolloutEngineError as exc:  # the engine is missing, unreachable or died: the message says what to do
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # training diverged (NonFiniteError): the message says what to try
        from grpokit.train.learner import NonFiniteError  # already imported by the run that raised

        if not isinstance(exc, NonFiniteError):
            raise
        print(f"grpo {cli.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

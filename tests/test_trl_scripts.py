"""TRL's own scripts on grpokit: TRL 1.16's trl/scripts/grpo.py, read from the installed package and run with only
its imports of GRPOConfig and GRPOTrainer switched to grpokit; GRPOConfig through HfArgumentParser / TrlParser
beside TRL's script dataclasses; the Trainer methods and results those scripts use after train()."""

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from grpokit.config import ConfigError, GRPOConfig
from grpokit.trainer import GRPOTrainer
from helpers import echo, frac_a, read_jsonl
from procs import run_tree
from test_trainer import config

trl = pytest.importorskip("trl", minversion="1.16")

# The only edit made to TRL's script: GRPOConfig and GRPOTrainer come from grpokit, everything else from trl.
IMPORT_SWITCHES = {
    "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n":
        "    from grpokit import GRPOTrainer\n"
        "    from trl import get_dataset, get_peft_config, get_quantization_config\n",
    "    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n":
        "    from grpokit import GRPOConfig\n    from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n",
}


def trl_script_on_grpokit() -> str:
    source = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    for trl_line, grpokit_lines in IMPORT_SWITCHES.items():
        assert source.count(trl_line) == 1, f"TRL's grpo.py no longer has {trl_line.strip()!r}"
        source = source.replace(trl_line, grpokit_lines)
    return source


def write_local_dataset(folder: Path) -> None:
    folder.mkdir()
    for split, rows in (("train", 12), ("test", 4)):
        lines = [json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) for i in range(rows)]
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")


def test_trls_own_grpo_script_runs_to_the_end_on_grpokit(tmp_path, tiny_model_dir):
    (tmp_path / "grpo.py").write_text(trl_script_on_grpokit())
    (tmp_path / "my_rewards.py").write_text(
        "def reward_len(completions, **kwargs):\n    return [-abs(6 - len(c)) for c in completions]\n")
    write_local_dataset(tmp_path / "zen")
    recipe = {  # a TRL recipe: TRL options grpokit ignores, at-default ones, and a steps_per_generation TRL accepts
        "model_name_or_path": tiny_model_dir, "dataset_name": str(tmp_path / "zen"),
        "reward_funcs": ["my_rewards.reward_len"], "output_dir": str(tmp_path / "out"), "report_to": "none",
        "per_device_train_batch_size": 4, "num_generations": 4, "gradient_accumulation_steps": 2,
        "steps_per_generation": 3, "max_completion_length": 8, "learning_rate": 1e-3, "logging_steps": 1,
        "accelerator_config": {"dispatch_batches": False}, "dataloader_num_workers": 2, "bf16": False,
        "gradient_checkpointing": False, "use_liger_kernel": False, "lr_scheduler_type": "cosine_with_min_lr",
        "push_to_hub": True, "hub_model_id": str(tmp_path / "hub"), "disable_tqdm": True, "seed": 0,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "grpo.py", "--config", "recipe.yaml", "--max_steps", "3",
               "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}']  # a mapping on the command line: JSON text
    done = run_tree(command, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Training completed." in done.stdout and "Model saved to" in done.stdout
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3] and all(row["reward"] <= 0 for row in rows)
    assert rows[-1]["learning_rate"] == pytest.approx(1e-4)  # cosine to min_lr_rate x learning_rate
    assert (tmp_path / "out" / "model.safetensors").is_file()
    pushed = tmp_path / "hub"
    assert (pushed / "model.safetensors").is_file() and "with GRPO" in (pushed / "README.md").read_text()


# ------------------------------------------------------------------ HfArgumentParser / TrlParser
def parse(args: list[str]):
    from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser

    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig))
    return parser.parse_args_and_config(args=args, fail_with_unknown_args=False)


def test_grpo_config_parses_beside_trls_script_dataclasses(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "dataset_name": "zen", "model_name_or_path": "tiny", "beta": 0.04, "report_to": "none",
        "accelerator_config": {"dispatch_batches": False}, "dataloader_num_workers": 2, "eval_delay": 0,
        "generation_kwargs": {"min_new_tokens": 2}, "tools": ["calculator"],
    }))
    script, training, model, _ = parse([
        "--config", str(path), "--output_dir", str(tmp_path / "out"), "--num_generations", "4",
        "--per_device_train_batch_size", "4", "--lr_scheduler_type", "cosine_with_min_lr",
        "--lr_scheduler_kwargs", '{"min_lr_rate": 0.1}', "--shuffle_dataset", "false", "--no_log_completions",
        "--resume_from_checkpoint", "out/checkpoint-2", "--tool_call_format", "qwen", "--max_prompt_length", "64"])
    assert script.dataset_name == "zen" and model.model_name_or_path == "tiny"
    assert isinstance(training, GRPOConfig) and training.beta == 0.04 and training.report_to == []
    assert training.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and training.generation_kwargs == {"min_new_tokens": 2}
    assert training.shuffle_dataset is False and training.log_completions is False
    assert training.tool_call_format == "qwen" and training.tools == ["calculator"]
    assert training.accelerator_config.dispatch_batches is False and training.dataloader_num_workers == 2
    assert training.resume_from_checkpoint == "out/checkpoint-2"  # read back by the script; the trainer ignores it
    assert training.max_prompt_length == 64 and training.gradient_checkpointing_kwargs is None


def test_every_trl_option_is_read_back_and_refused_off_its_default_from_every_entry():
    args, = parse(["--output_dir", "o"])[1:2]
    assert args.resume_from_checkpoint is None and args.optim == "adamw_torch_fused" and args.fsdp is None
    with pytest.raises(ConfigError, match="fp16=True is a TRL option grpokit does not implement"):
        parse(["--output_dir", "o", "--fp16", "true"])
    with pytest.raises(ConfigError, match="fp16=True is a TRL option grpokit does not implement"):
        GRPOConfig.from_dict({"fp16": "true"})
    with pytest.raises(ConfigError, match="accelerator_config=.* is not an accelerator config"):
        GRPOConfig(accelerator_config={"dispatch_batch": False})
    assert GRPOConfig(accelerator_config='{"split_batches": true}').accelerator_config.split_batches is True


def test_the_cli_reads_trl_options_too(tmp_path):
    from grpokit.cli import build_parser, merge_train_options

    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text("model: m\ndataset: d.jsonl\nreward_funcs: [x]\n"
                         "accelerator_config: {dispatch_batches: false}\n")
    cli = build_parser().parse_args(["train", str(yaml_file), "--dataloader_num_workers", "3",
                                     "--optim", "adamw_torch"])
    _, config_ = merge_train_options(yaml.safe_load(yaml_file.read_text()), cli)
    assert config_.dataloader_num_workers == 3 and config_.accelerator_config.dispatch_batches is False


# ------------------------------------------------------------------ the Trainer's tail
def test_train_returns_trls_train_output_that_reads_as_the_state(tmp_path, tiny_model_dir, prompt_dataset, capsys):
    from transformers.trainer_utils import TrainOutput

    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=2), prompt_dataset)
    result = trainer.train()
    assert isinstance(result, TrainOutput) and result.global_step == 2
    global_step, training_loss, metrics = result
    assert training_loss == result.training_loss == trainer.state.log_history[-1]["train_loss"]
    assert {"train_loss", "train_runtime", "train_samples_per_second", "train_steps_per_second",
            "epoch"} <= set(metrics)
    assert result.log_history is trainer.state.log_history and result.interrupted is None and result.max_steps == 2
    trainer.log_metrics("train", metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text())["train_loss"] == training_loss
    assert json.loads((out / "all_results.json").read_text())["epoch"] == metrics["epoch"]
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 2
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()


def test_save_model_push_to_hub_model_card_and_end(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=1, hub_model_id=str(tmp_path / "hub"))
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
    trainer.train()
    (tmp_path / "out" / "model.safetensors").unlink()
    trainer.save_model()  # no argument: output_dir
    trainer.save_model(output_dir=str(tmp_path / "elsewhere"))
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert (tmp_path / "elsewhere" / "model.safetensors").is_file()
    assert trainer.push_to_hub(dataset_name="zen") == str(tmp_path / "hub") == trainer.state.pushed_to
    card = (tmp_path / "hub" / "README.md").read_text()
    assert "datasets: zen" in card and "grpokit" in card
    assert trainer.hub_model_id == str(tmp_path / "hub")
    with pytest.raises(ConfigError, match="hf auth login"):
        trainer.push_to_hub(token="hf_x")
    trainer.end()


def test_trainer_tools_can_be_assigned_as_in_trl(tmp_path, tiny_model_dir, prompt_dataset):
    trainer = GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, max_steps=1), prompt_dataset)
    assert trainer.tools == [] and not trainer.setup.agent.agentic
    trainer.tools = [echo]
    assert trainer.tools == [echo] and trainer.setup.agent.agentic and trainer.collector.setup is trainer.setup
    trainer.tools = None
    assert trainer.tools == [] and not trainer.setup.agent.agentic
    assert trainer.train().global_step == 1


def test_iterable_datasets_follow_trls_rules(tmp_path, tiny_model_dir, prompt_dataset):
    stream = prompt_dataset.to_iterable_dataset()
    args = config(tmp_path, max_steps=1, dataloader_num_workers=4)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, stream)
    assert trainer.args.accelerator_config.dispatch_batches is False and trainer.args.dataloader_num_workers == 0
    with pytest.raises(ValueError, match="Iterable datasets require `dispatch_batches=False`"):
        GRPOTrainer(tiny_model_dir, frac_a, config(tmp_path, accelerator_config={"dispatch_batches": True}), stream)
    kept = config(tmp_path, max_steps=1, dataloader_num_workers=4)
    GRPOTrainer(tiny_model_dir, frac_a, kept, prompt_dataset, eval_dataset=stream.take(2))
    assert kept.dataloader_num_workers == 4 and kept.accelerator_config.dispatch_batches is False


def test_a_trl_option_set_after_init_is_kept(tmp_path):
    args = config(tmp_path)
    args.resume_from_checkpoint = "x"
    assert dataclasses.replace(args).resume_from_checkpoint == "x"


def test_an_open_r1_style_script_runs_and_resumes_from_its_last_checkpoint(tmp_path, tiny_model_dir):
    """tests/scripts/open_r1_style_grpo.py is built as open-r1's grpo.py: a GRPOConfig subclass with the script's
    own fields, get_process_log_level / device / n_gpu before the trainer, get_last_checkpoint, the Trainer's tail."""
    data = tmp_path / "problems"
    data.mkdir()
    for split, rows in (("train", 12), ("test", 4)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"problem": f"{i}+{i}"}) + "\n" for i in range(rows)))
    recipe = {
        "model_name_or_path": tiny_model_dir, "dataset_name": str(data), "output_dir": str(tmp_path / "out"),
        "system_prompt": "Add.", "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}=",
        "benchmarks": ["math_500"], "log_level": "info", "report_to": "none", "per_device_train_batch_size": 4,
        "num_generations": 4, "max_completion_length": 8, "save_strategy": "steps", "save_steps": 2,
        "eval_strategy": "steps", "eval_steps": 100, "do_eval": True, "logging_steps": 1, "disable_tqdm": True,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    script = str(Path(__file__).parent / "scripts" / "open_r1_style_grpo.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    first = run_tree([sys.executable, script, "--config", "recipe.yaml", "--max_steps", "2"], timeout=300,
                     cwd=tmp_path, env=env)
    assert first.returncode == 0, first.stderr[-4000:]
    assert "device: cpu, n_gpu: 0 distributed training: False" in first.stdout + first.stderr
    assert "resumed from: None" in first.stdout
    out = tmp_path / "out"
    assert json.loads((out / "train_results.json").read_text())["train_samples"] == 12
    assert "eval_samples" in json.loads((out / "all_results.json").read_text())
    assert "open-r1" in (out / "README.md").read_text() and json.loads((out / "config.json").read_text())["use_cache"]
    second = run_tree([sys.executable, script, "--config", "recipe.yaml", "--max_steps", "3"], timeout=300,
                      cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr[-4000:]
    assert f"resumed from: {out / 'checkpoint-2'}" in second.stdout
    assert [row["step"] for row in read_jsonl(out / "metrics.jsonl") if "reward" in row] == [1, 2, 3]


def test_training_arguments_process_facts_read_as_under_transformers():
    from transformers import TrainingArguments
    from transformers.utils import logging as hf_logging

    ours = GRPOConfig(output_dir="o", per_device_train_batch_size=4, num_generations=4, warmup_ratio=0.1)
    theirs = TrainingArguments(output_dir="o", per_device_train_batch_size=4, warmup_steps=0.1, use_cpu=True)
    for name in ("device", "n_gpu", "world_size", "process_index", "local_process_index", "should_log",
                 "should_save", "train_batch_size", "parallel_mode"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.eval_batch_size == 4  # per_device_eval_batch_size=None: grpokit evaluates in training's batches
    assert ours.get_warmup_steps(25) == theirs.get_warmup_steps(25) == 3
    assert ours.get_process_log_level() == theirs.get_process_log_level() == hf_logging.get_verbosity()
    assert GRPOConfig(output_dir="o", log_level="error").get_process_log_level() == 40
    assert ours.to_dict()["num_generations"] == 4 and json.loads(ours.to_json_string())["output_dir"] == "o"
    sanitized = ours.to_sanitized_dict()
    assert sanitized["report_to"] == "[]" and sanitized["learning_rate"] == ours.learning_rate
    with ours.main_process_first(desc="map"):
        pass

"""An open-r1-style recipe (TRL's script keys beside GRPOConfig options) through `grpo train`, unchanged but for
the model and dataset locations; each script key's translation; push_to_hub to a local folder."""

import json
import subprocess
import sys
import textwrap

import datasets
import pytest

from grpokit.config import ConfigError
from grpokit.recipe import peft_config, prepare_dataset, recipe_run

# open-r1's recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml, with the model, dataset and hub id pointing at
# local stand-ins, a CPU-sized batch and length, report_to none and use_vllm false (a CPU run of this tiny model)
RECIPE = """\
# Model arguments
model_name_or_path: {model}
model_revision: main
torch_dtype: bfloat16
attn_implementation: flash_attention_2

# Data training arguments
dataset_name: {data}
dataset_prompt_column: problem
system_prompt: "You are a helpful AI Assistant that provides well-reasoned and detailed responses. You first think about the reasoning process as an internal monologue and then provide the user with the answer. Respond in the following format: <think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>"

# GRPO trainer config
bf16: true
use_vllm: false
do_eval: false
gradient_accumulation_steps: 1
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: {hub}
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine
max_prompt_length: 512
max_completion_length: 16
max_steps: -1
num_generations: 4
num_train_epochs: 1
output_dir: {out}
overwrite_output_dir: true
per_device_eval_batch_size: 8
per_device_train_batch_size: 8
push_to_hub: true
reward_funcs:
- accuracy
- format
- tag_count
reward_weights:
- 1.0
- 1.0
- 1.0
report_to:
- none
save_strategy: "epoch"
save_total_limit: 1
seed: 42
temperature: 0.7
warmup_ratio: 0.1
"""


@pytest.fixture
def math_data(tmp_path):
    folder = tmp_path / "openr1-math"
    folder.mkdir()
    rows = [{"problem": f"What is {i} + {i}?", "solution": f"$\\boxed{{{2 * i}}}$"} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_an_open_r1_recipe_runs_through_grpo_train(tmp_path, tiny_model_dir, math_data):
    config = tmp_path / "config_demo.yaml"
    out, hub = tmp_path / "data" / "Qwen2.5-1.5B-Open-R1-GRPO", tmp_path / "hub" / "Qwen2.5-1.5B-Open-R1-GRPO"
    config.write_text(RECIPE.format(model=tiny_model_dir, data=math_data, hub=hub, out=out))
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(config)], capture_output=True,
                          text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flash_attention_2 needs CUDA" in proc.stderr  # fell back to sdpa, said so
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # 8 prompts x 4 completions / 8 per step, 1 epoch
    assert {"rewards/math_accuracy/mean", "rewards/format/mean", "rewards/tag_structure/mean"} <= set(rows[0])
    completion = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert completion["prompt"][0]["role"] == "system" and completion["prompt"][1]["content"].startswith("What is ")
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]  # save_strategy epoch
    assert sorted(p.name for p in hub.iterdir()) == sorted(p.name for p in out.iterdir() if p.is_file())
    assert f"pushed to: {hub}" in proc.stderr
    saved = json.loads((out / "config.json").read_text())
    assert saved["dtype"] == "bfloat16"


def test_script_keys_translate_as_the_scripts_read_them():
    values, recipe = recipe_run({
        "model_name_or_path": "org/model", "model_revision": "v2", "torch_dtype": "bfloat16",
        "attn_implementation": "sdpa", "dataset_name": "org/data", "dataset_config": "default",
        "dataset_train_split": "train[:90%]", "dataset_test_split": "test", "eval_strategy": "steps",
        "model_init_kwargs": {"dtype": "float32"}, "learning_rate": 1e-5,
    })
    assert values == {
        "model": "org/model", "learning_rate": 1e-5, "eval_strategy": "steps",
        "model_init_kwargs": {"revision": "v2", "dtype": "float32", "attn_implementation": "sdpa"},  # explicit wins
        "dataset": {"path": "org/data", "name": "default", "split": "train[:90%]"},
        "eval_dataset": {"path": "org/data", "name": "default", "split": "test"},
    }
    assert recipe["dataset_test_split"] == "test"
    without_eval, _ = recipe_run({"dataset_name": "org/data", "dataset_test_split": "test"})
    assert "eval_dataset" not in without_eval
    with pytest.raises(ConfigError, match="both 'model' and 'model_name_or_path'"):
        recipe_run({"model": "a", "model_name_or_path": "b"})


def test_prompts_become_open_r1_conversations():
    data = datasets.Dataset.from_list([{"problem": "1+1?", "prompt": "old", "solution": "2"}])
    converted = prepare_dataset(data, {"dataset_prompt_column": "problem", "system_prompt": "Think."})
    assert converted[0]["prompt"] == [{"role": "system", "content": "Think."}, {"role": "user", "content": "1+1?"}]
    assert converted[0]["solution"] == "2"
    assert prepare_dataset(data, {}) is data
    with pytest.raises(ConfigError, match="'question' is not a column"):
        prepare_dataset(data, {"dataset_prompt_column": "question"})


def test_use_peft_builds_trls_default_lora():
    lora = peft_config({"use_peft": True, "lora_r": 8, "lora_target_modules": ["q_proj"]})
    assert (lora.r, lora.lora_alpha, lora.lora_dropout, set(lora.target_modules)) == (8, 32, 0.05, {"q_proj"})
    assert peft_config({}) is None
    with pytest.raises(ConfigError, match="lora_r given without use_peft"):
        peft_config({"lora_r": 8})


def test_a_failed_push_keeps_the_model_and_says_how_to_push_later(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    from grpokit.trainer import GRPOTrainer
    from helpers import frac_a
    from test_trainer import config

    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would go")
    args = config(tmp_path, max_steps=1, push_to_hub=True, hub_model_id=str(blocker / "model"))
    state = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset).train()
    assert state.pushed_to is None and (tmp_path / "out" / "model.safetensors").is_file()
    assert "push_to_hub to" in caplog.text and "hf upload" in caplog.text


def test_help_text_of_the_recipe_module_lists_every_key():
    import grpokit.recipe as recipe

    for key in recipe.RECIPE_KEYS:
        assert key in textwrap.dedent(recipe.__doc__), key

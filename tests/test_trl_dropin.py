"""TRL's option names and value forms, and the TrainingArguments a recipe uses, through the Python constructor, a
YAML dict and the command line; the lifecycle a TRL user expects (log_history, window means, epoch, periodic
evaluation, epoch checkpoints, interrupted runs, resume to a new max_steps)."""

import dataclasses
import math
import os
import signal

import pytest

from grpokit.config import ConfigError, GRPOConfig, load_yaml
from grpokit.trainer import GRPOTrainer, window_mean
from grpokit.config.trl_compat import AT_DEFAULT_ONLY, IGNORED, IMPLEMENTED, TRL_FIELDS
from helpers import frac_a, read_jsonl
from test_trainer import config  # the tiny run's settings


# ------------------------------------------------------------------ value forms
@pytest.mark.parametrize("value, expected", [
    ("none", []), ("no", []), (None, []), ([], []), (["none"], []), ("wandb", ["wandb"]),
    ("wandb,trackio", ["wandb", "trackio"]), (["wandb"], ["wandb"]),
])
def test_report_to_in_trl_forms(value, expected, monkeypatch):
    import grpokit.observe.metrics

    monkeypatch.setattr(grpokit.observe.metrics, "check_sinks", lambda report_to: None)
    assert GRPOConfig(report_to=value).report_to == expected
    assert GRPOConfig.from_dict({"report_to": value}).report_to == expected


def test_report_to_all_means_every_installed_tracker(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "wandb" else (
        None if name in ("tensorboard", "trackio") else real(name, *a)))
    assert GRPOConfig(report_to="all").report_to == ["wandb"]


@pytest.mark.parametrize("text", ["1e-5", "1E-5", "1.0e-5", "0.00001"])
def test_floats_in_any_yaml_or_cli_form(text, tmp_path):
    assert GRPOConfig.from_dict({"learning_rate": text}).learning_rate == pytest.approx(1e-5, rel=1e-12)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text(f"learning_rate: {text}\n")
    assert GRPOConfig.from_dict(load_yaml(yaml_file)).learning_rate == pytest.approx(1e-5, rel=1e-12)
    assert GRPOConfig(learning_rate=text).learning_rate == pytest.approx(1e-5, rel=1e-12)


def test_scale_rewards_true_false_as_trl():
    assert GRPOConfig(scale_rewards=True).scale_rewards == "group"
    assert GRPOConfig(scale_rewards=False).scale_rewards == "none"
    assert GRPOConfig.from_dict({"scale_rewards": "false"}).scale_rewards == "none"


def test_a_non_number_string_for_a_float_is_still_an_error():
    with pytest.raises(ConfigError, match="learning_rate='fast' should be float"):
        GRPOConfig.from_dict({"learning_rate": "fast"})


# ------------------------------------------------------------------ TRL options and unknown keys
BAD = {"use_liger_kernel": True, "torch_dtype": "bfloat16", "lerning_rate": 1e-5, "fp16": True, "learning_rate": "x"}


def test_every_problem_is_reported_at_once_from_yaml_and_python():
    with pytest.raises(ConfigError) as from_yaml:
        GRPOConfig.from_dict(BAD)
    text = str(from_yaml.value)
    assert text.startswith("5 problems in the options:")
    for expected in ["use_liger_kernel=True is a TRL option grpokit does not implement (accepted only at False)",
                     "Unknown option 'torch_dtype'. It is not a GRPOConfig option: set model_init_kwargs: {dtype: "
                     "bfloat16}", "Unknown option 'lerning_rate'. Did you mean 'learning_rate'?",
                     "fp16=True is a TRL option grpokit does not implement", "learning_rate='x' should be float"]:
        assert expected in text
    python_bad = {k: v for k, v in BAD.items() if k != "learning_rate"}
    with pytest.raises(ConfigError) as from_python:
        GRPOConfig(**python_bad)
    assert str(from_python.value).startswith("4 problems in the options:")
    for line in str(from_python.value).splitlines()[1:]:
        assert line in text


def test_trl_options_at_their_defaults_are_accepted():
    values = {name: (default[0] if isinstance(default, tuple) else default)
              for name, (default, _) in AT_DEFAULT_ONLY.items()}
    values.update(dataloader_num_workers=4, use_cache=True, ddp_timeout=60, log_level="info", do_eval=True)
    c = GRPOConfig(**values)
    assert c.use_liger_kernel is False and c.dataloader_num_workers == 4 and c.do_eval is True  # read back
    GRPOConfig.from_dict(values)


def test_the_tables_cover_every_trl_1_16_option_and_read_back_its_default():
    trl = pytest.importorskip("trl", minversion="1.16")
    tables = (set(IGNORED), set(AT_DEFAULT_ONLY), set(IMPLEMENTED))
    assert set(TRL_FIELDS) == set.union(*tables) and sum(map(len, tables)) == len(TRL_FIELDS)
    ours = set(GRPOConfig.__dataclass_fields__) - set(TRL_FIELDS)
    config = GRPOConfig()
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.name in ours:
            continue
        assert f.name in TRL_FIELDS, f"TRL option {f.name} is in no table"
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert TRL_FIELDS[f.name][1] == default, f.name
        if f.name in AT_DEFAULT_ONLY:
            listed = AT_DEFAULT_ONLY[f.name][0]
            assert default == listed or (isinstance(listed, tuple) and default in listed), f.name
        if f.name != "accelerator_config":  # read back as TrainingArguments makes it: an AcceleratorConfig
            assert getattr(config, f.name) == default, f.name
    assert config.accelerator_config.dispatch_batches is None


def test_cli_reports_the_same_problems(tmp_path, capsys):
    from grpokit.cli import main

    yaml_file = tmp_path / "recipe.yaml"
    yaml_file.write_text("model: m\ndataset: d.jsonl\nreward_funcs: [x]\nuse_liger_kernel: true\nlerning_rate: 1\n")
    code = main(["train", str(yaml_file)])
    err = capsys.readouterr().err
    assert code != 0
    assert "2 problems in the options:" in err and "use_liger_kernel=True" in err and "'lerning_rate'" in err


# ------------------------------------------------------------------ schedules
def test_every_transformers_schedule_with_kwargs(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=4, lr_scheduler_type="cosine_with_min_lr",
                  lr_scheduler_kwargs={"min_lr_rate": 0.1}, learning_rate=1e-3)
    state = GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset).train()
    lrs = [row["learning_rate"] for row in state.log_history if "learning_rate" in row]
    # cosine from 1e-3 to 1e-4 over 4 steps: after step k, 1e-4 + 0.45e-3 (1 + cos(pi k / 4))
    expected = [1e-4 + 0.45e-3 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)]
    assert lrs == pytest.approx(expected, rel=1e-9)


def test_a_schedule_missing_its_kwargs_fails_before_any_model_loads():
    with pytest.raises(ConfigError, match="min_lr or min_lr_rate"):
        GRPOConfig(lr_scheduler_type="cosine_with_min_lr")


# ------------------------------------------------------------------ logging and lifecycle
def test_window_mean_rules():
    rows = [{"loss": 1.0, "learning_rate": 0.3, "completions/max_length": 5, "completions/min_length": 2,
             "kl": float("nan"), "nonfinite_skipped": 0},
            {"loss": 3.0, "learning_rate": 0.2, "completions/max_length": 7, "completions/min_length": 4, "kl": 0.5,
             "nonfinite_skipped": 1}]
    assert window_mean(rows) == {"loss": 2.0, "learning_rate": 0.2, "completions/max_length": 7,
                                 "completions/min_length": 2, "kl": 0.5, "nonfinite_skipped": 1}


def test_logging_steps_logs_the_window_mean_and_log_history(tmp_path, tiny_model_dir, prompt_dataset):
    every = GRPOTrainer(tiny_model_dir, frac_a, args=config(tmp_path / "a", max_steps=4),
                        train_dataset=prompt_dataset).train()
    windowed = GRPOTrainer(tiny_model_dir, frac_a, args=config(tmp_path / "b", max_steps=4, logging_steps=2,
                                                               logging_first_step=True),
                           train_dataset=prompt_dataset).train()
    per_step = {row["step"]: row for row in every.log_history if "loss" in row}
    rows, summary = windowed.log_history[:-1], windowed.log_history[-1]  # TRL's closing row: a row of its own
    assert [row["step"] for row in rows] == [1, 2, 4] and "loss" not in summary
    assert rows[2]["loss"] == pytest.approx((per_step[3]["loss"] + per_step[4]["loss"]) / 2, rel=1e-6)
    assert rows[2]["learning_rate"] == per_step[4]["learning_rate"]
    for written, kept in zip(read_jsonl(tmp_path / "b" / "out" / "metrics.jsonl"), rows, strict=True):
        assert written == pytest.approx({key: kept[key] for key in written})
    assert windowed.epoch > 0 and summary["epoch"] == windowed.epoch and summary["step"] == 4
    # TRL's closing row: the mean loss of the run's steps and its throughput
    losses = [per_step[s]["loss"] for s in range(1, 5)]
    assert every.log_history[-1]["train_loss"] == pytest.approx(sum(losses) / 4, rel=1e-6)
    assert len(every.log_history) == 5  # 4 steps, then the closing row, as TRL (transformers' Trainer.log)
    assert summary["train_steps_per_second"] == pytest.approx(4 / summary["train_runtime"], rel=1e-6)


def test_the_closing_row_holds_the_steps_logging_steps_did_not_log(tmp_path, tiny_model_dir, prompt_dataset):
    # TRL logs steps 2 and 4, and step 5 only in its closing row (with the step's mean metrics)
    state = GRPOTrainer(tiny_model_dir, frac_a, args=config(tmp_path, max_steps=5, logging_steps=2),
                        train_dataset=prompt_dataset).train()
    assert [row["step"] for row in state.log_history] == [2, 4, 5]
    assert {"loss", "reward", "train_loss", "train_runtime"} <= set(state.log_history[-1])


def test_periodic_and_start_evaluation(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, eval_on_start=True,
                  num_generations_eval=2, per_device_eval_batch_size=3)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset,
                          eval_dataset=prompt_dataset.select(range(3)))
    state = trainer.train()
    eval_steps = [row["step"] for row in state.log_history if "eval/reward" in row]
    assert eval_steps == [0, 2, 4]  # the final step was evaluated by the schedule, not twice
    logged = [row["step"] for row in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "eval/reward" in row]
    assert logged == eval_steps


def test_save_strategy_epoch(tmp_path, tiny_model_dir, prompt_dataset):
    # 12 prompts, 2 prompts per generation batch: one epoch = 6 steps
    args = config(tmp_path, max_steps=-1, num_train_epochs=2, save_strategy="epoch")
    GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset).train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-12", "checkpoint-6"]


def test_an_interrupted_train_says_so_and_resume_to_a_larger_max_steps_continues(tmp_path, tiny_model_dir,
                                                                                prompt_dataset):
    def stop_at_second_call(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return frac_a(prompts, completions)

    args = config(tmp_path, max_steps=3)
    state = GRPOTrainer(tiny_model_dir, stop_at_second_call, args=args, train_dataset=prompt_dataset).train()
    assert state.interrupted == "SIGTERM" and state.global_step == 2
    finished = GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset).train(True)
    assert finished.interrupted is None and finished.global_step == 3
    longer = config(tmp_path, max_steps=5, save_strategy="steps", save_steps=1)
    state = GRPOTrainer(tiny_model_dir, frac_a, args=longer, train_dataset=prompt_dataset).train(True)
    assert state.global_step == 5
    steps = [row for row in state.log_history if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2, 3, 4, 5]
    assert steps[-1]["learning_rate"] == 0.0 and steps[-2]["learning_rate"] > 0
    assert "train_loss" in state.log_history[-1] and state.log_history[-1]["step"] == 5


def test_resume_a_finished_run_with_a_larger_max_steps(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=4, save_strategy="steps", save_steps=2)
    GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset).train()
    more = config(tmp_path, max_steps=6, save_strategy="steps", save_steps=2)
    state = GRPOTrainer(tiny_model_dir, frac_a, args=more, train_dataset=prompt_dataset).train(True)
    assert state.global_step == 6
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[4]["learning_rate"] > 0  # the schedule was rebuilt for 6 steps, not left at 0 after step 4


def test_compute_metrics_and_the_best_model(tmp_path, tiny_model_dir, prompt_dataset):
    def has_a(prompts, completions, **kwargs):
        return [float("a" in c) for c in completions]

    def only_math(prompts, completions, task, **kwargs):
        return [len(c) if t == "math" else None for c, t in zip(completions, task)]

    args = config(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=1,
                  metric_for_best_model="metrics/has_a/mean", load_best_model_at_end=True, num_generations_eval=4)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset,
                          eval_dataset=prompt_dataset.select(range(4)), compute_metrics=[has_a, only_math])
    state = trainer.train()
    evals = [row for row in state.log_history if "eval/reward" in row]
    assert [row["step"] for row in evals] == [1, 2, 3, 4]
    for row in evals:
        assert 0 <= row["eval/metrics/has_a/mean"] <= row["eval/metrics/has_a/pass@4"] <= 1
        assert "eval/metrics/only_math/pass@4" not in row and row["eval/metrics/only_math/mean"] > 0
    best = max(evals, key=lambda row: row["eval/metrics/has_a/mean"])
    assert state.best_metric == best["eval/metrics/has_a/mean"]
    import json
    saved = json.loads((tmp_path / "out" / "best" / "best.json").read_text())
    assert saved["step"] == min(r["step"] for r in evals if r["eval/metrics/has_a/mean"] == state.best_metric)
    import safetensors.torch as st
    final = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    kept = st.load_file(str(tmp_path / "out" / "best" / "model.safetensors"))
    assert all((final[k] == kept[k]).all() for k in kept)


def test_eval_options_need_an_eval_dataset(tmp_path, tiny_model_dir, prompt_dataset):
    with pytest.raises(ConfigError, match="need an eval_dataset"):
        GRPOTrainer(tiny_model_dir, frac_a, args=config(tmp_path, eval_strategy="steps"), train_dataset=prompt_dataset)
    with pytest.raises(ConfigError, match="load_best_model_at_end=True needs periodic evaluation"):
        config(tmp_path, load_best_model_at_end=True)


def test_health_alarms_are_logged_during_training_once(tmp_path, tiny_model_dir, prompt_dataset, caplog):
    args = config(tmp_path, max_steps=5, max_completion_length=2)  # every completion is cut off
    with caplog.at_level("WARNING", logger="grpokit.trainer"):
        GRPOTrainer(tiny_model_dir, frac_a, args=args, train_dataset=prompt_dataset).train()
    truncation = [r.getMessage() for r in caplog.records if "Truncated completions" in r.getMessage()]
    assert len(truncation) == 1, [r.getMessage() for r in caplog.records]


# TRL's documented GRPO quick start (docs: GRPO Trainer, "Quick start"), with the hub model and dataset replaced by
# local stand-ins and the run shortened; the test changes only the import line.
TRL_QUICK_START = '''
from trl import GRPOConfig, GRPOTrainer

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(output_dir=OUTPUT_DIR, report_to="none", logging_steps=10, max_steps=2,
                           per_device_train_batch_size=8, num_generations=8, max_completion_length=24,
                           learning_rate=1e-5, use_liger_kernel=False, bf16=False, gradient_checkpointing=False)
trainer = GRPOTrainer(
    model=MODEL,
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
'''


def test_trl_quick_start_runs_with_only_the_import_changed(tmp_path, tiny_model_dir, prompt_dataset):
    source = TRL_QUICK_START.replace("from trl import", "from grpokit import")
    namespace = {"OUTPUT_DIR": str(tmp_path / "Qwen2-0.5B-GRPO"), "MODEL": tiny_model_dir, "dataset": prompt_dataset}
    exec(compile(source, "trl_quick_start", "exec"), namespace)
    state = namespace["trainer"].state
    assert state.global_step == 2 and state.log_history[-1]["step"] == 2
    assert state.log_history[-1]["reward"] < 0  # -|20 - len|: the reward the script defined


@pytest.mark.parametrize("value", [1.5, "surely-not-a-default", 7])
@pytest.mark.parametrize("name", sorted(AT_DEFAULT_ONLY))
def test_a_trl_option_off_its_default_is_a_config_error_whatever_its_type(name, value):
    with pytest.raises(ConfigError, match=f"{name}=.* is a TRL option grpokit does not implement"):
        GRPOConfig(**{name: value})

"""The `grpo` command in a subprocess: help, a short `grpo train` run on the example YAML, override errors."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

from grpokit.cli import build_parser, main
from vllm_support import requires_vllm
from helpers import read_jsonl

ROOT = Path(__file__).resolve().parent.parent


def grpo(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "grpokit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_lists_subcommands_and_every_option():
    top = grpo("--help")
    assert top.returncode == 0 and "train" in top.stdout and "demo" in top.stdout
    train = grpo("train", "--help")
    assert train.returncode == 0
    assert "--num_generations" in train.stdout and "completions sampled per prompt" in train.stdout
    assert "--epsilon_high" in train.stdout and "--resume" in train.stdout
    flat = " ".join(train.stdout.split())
    # choices come from the registries
    assert "Choices: bnpo, cispo, clip, dapo, dr_grpo, gmpo, grpo, luspo, sapo, sequence_sum, vespo." in flat
    assert "Choices: grpo, reinforce_plus_plus_baseline, rloo." in flat


def test_grpo_train_on_the_example_yaml(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    result = grpo("train", "examples/tiny_add.yaml", "--model", tiny_model_dir, "--output_dir", str(out),
                  "--max_steps", "3", "--save_steps", "2", "--logging_steps", "1", "--disable_tqdm", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert {"rewards/correctness_reward/mean", "rewards/format_reward/mean", "rewards/repetition_penalty/mean",
            "kl"} <= set(rows[0])
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    assert (out / "model.safetensors").is_file()


def test_command_line_beats_yaml_and_bad_values_are_clear(tmp_path):
    parser = build_parser()
    from grpokit.cli import merge_train_options

    cli = parser.parse_args(["train", "x.yaml", "--beta", "0.5", "--model", "m"])
    run, config = merge_train_options({"model": "a", "dataset": "d", "reward_funcs": "exact_match", "beta": 0.1}, cli)
    assert config.beta == 0.5 and run["model"] == "m" and run["reward_funcs"] == ["exact_match"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\ndataset: d\nreward_funcs: [exact_match]\nnum_generation: 4\n")
    result = grpo("train", str(bad))
    assert result.returncode == 2
    assert "Unknown option 'num_generation'. Did you mean 'num_generations'?" in result.stderr
    missing = tmp_path / "missing.yaml"
    missing.write_text("dataset: d\nreward_funcs: [exact_match]\n")
    result = grpo("train", str(missing))
    assert result.returncode == 2 and "The config needs 'model'" in result.stderr


def test_the_demo_yaml_trains_and_scores_the_held_out_split(tmp_path):
    out = tmp_path / "demo"
    result = grpo("train", "examples/demo.yaml", "--output_dir", str(out), "--max_steps", "2", "--disable_tqdm", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows[:2]] == [1, 2]
    evaluation = rows[-1]
    assert set(evaluation) == {"step", "eval/reward", "eval/loss", "eval/rewards/format_reward/mean",
                               "eval/rewards/correctness_reward/mean"}
    assert math.isfinite(evaluation["eval/loss"])
    # the shipped warm model writes the format most of the time and is right on some held-out sums
    assert evaluation["eval/rewards/format_reward/mean"] > 0.5
    assert 0.1 < evaluation["eval/rewards/correctness_reward/mean"] < 0.9


@requires_vllm
def test_vllm_serve_builds_the_server_command(capsys):
    assert main(["vllm-serve", "--model", "some/model", "--port", "9001", "--dry-run", "--max-num-seqs", "8"]) == 0
    out = capsys.readouterr().out
    assert "-m vllm.entrypoints.openai.api_server --model some/model" in out
    assert "--port 9001" in out and "--logprobs-mode processed_logprobs" in out and out.rstrip().endswith(
        "VLLM_SERVER_DEV_MODE=1")
    assert "--max-num-seqs 8" in out  # unknown arguments go to vLLM unchanged


def test_unknown_arguments_are_still_errors_for_train(tmp_path, capsys):
    recipe = tmp_path / "x.yaml"
    recipe.write_text("model: m\ndataset: d\nreward_funcs: [exact_match]\n")
    assert main(["train", str(recipe), "--no_such_option", "1", "--use_liger_kernel", "true"]) == 2
    err = capsys.readouterr().err
    assert "2 problems in the options:" in err and "Unknown option 'no_such_option'" in err
    assert "use_liger_kernel=True is a TRL option" in err
    with pytest.raises(SystemExit) as exit_info:
        main(["train", str(recipe), "stray"])
    assert exit_info.value.code == 2


def test_trl_command_line_forms_and_the_summary(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    result = grpo("train", "examples/tiny_add.yaml", "--model", tiny_model_dir, "--output_dir", str(out),
                  "--max_steps", "2", "--learning_rate", "1e-5", "--report_to", "none", "--use_liger_kernel",
                  "false", "--dataloader_num_workers", "2", "--scale_rewards", "true", "--disable_tqdm", "true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grpo train: finished at step 2 of 2" in result.stderr
    assert f"model: {out}" in result.stderr and f"grpo report {out}" in result.stderr


def test_train_help_opens_with_usage_and_the_common_options():
    first_screen = grpo("train", "--help").stdout.splitlines()[:12]
    text = "\n".join(first_screen)
    assert first_screen[0].startswith("usage: grpo train [CONFIG.yaml] [--model M]")
    assert "--learning_rate" in text and "--num_generations" in text and "--output_dir" in text
    assert "grpo train --help | less" in text


def test_train_without_yaml_names_what_is_missing_in_one_line(capsys):
    assert main(["train", "--model", "m"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "grpo train: error: give a YAML config, or --model, --dataset and --reward_funcs (missing: "
        "--dataset, --reward_funcs); see grpo train --help."]


def test_an_unknown_options_value_is_not_read_as_the_config(capsys):
    args = ["train", "--model", "m", "--dataset", "d", "--reward_funcs", "exact_match", "--use_liger_kernel", "true",
            "--no_such_option", "1"]
    assert main(args) == 2  # the options are judged before any model or dataset loads
    err = capsys.readouterr().err
    assert "Unknown option 'no_such_option'" in err and "use_liger_kernel=True is a TRL option" in err
    assert "does not exist" not in err  # no YAML file named "true" or "1" was looked for


def test_train_without_yaml_then_resume_says_which_checkpoint_it_loaded(tmp_path):
    out = tmp_path / "run"
    options = ["--model", "grpokit/demo/assets", "--dataset", "examples/data/add_carry.jsonl", "--reward_funcs",
               "grpokit.demo.task:correctness_reward", "--output_dir", str(out), "--num_generations", "4",
               "--per_device_train_batch_size", "8", "--max_completion_length", "24", "--save_strategy", "steps",
               "--save_steps", "1", "--logging_steps", "1", "--disable_tqdm", "true"]
    first = grpo("train", *options, "--max_steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "grpo train: finished at step 2 of 2" in first.stderr
    resumed = grpo("train", *options, "--max_steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"grpokit: Resumed from {out / 'checkpoint-2'} at step 2." in resumed.stderr
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    named = grpo("train", *options, "--max_steps", "3", "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert named.returncode == 0, named.stderr[-3000:]  # TRL's option, read as TRL's scripts read it
    assert f"grpokit: Resumed from {out / 'checkpoint-2'} at step 2." in named.stderr


def test_vllm_serve_listens_on_localhost_unless_told(capsys):
    from grpokit.cli import is_loopback, vllm_serve_command

    argv, env = vllm_serve_command(build_parser().parse_args(["vllm-serve", "--model", "m"]), [])
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.org")


@requires_vllm
def test_vllm_serve_on_another_address_warns(capsys):
    assert main(["vllm-serve", "--model", "m", "--host", "0.0.0.0", "--dry-run"]) == 0
    captured = capsys.readouterr()
    assert "--host 0.0.0.0" in captured.out
    assert "grpo vllm-serve: warning: listening on 0.0.0.0" in captured.err and "--host 127.0.0.1" in captured.err


def test_demo_takes_train_s_underscore_spellings_too():
    from grpokit.cli import build_parser

    for output, vllm in (("--output_dir", "--use_vllm"), ("--output-dir", "--use-vllm")):
        cli = build_parser().parse_args(["demo", output, "somewhere", vllm])
        assert cli.output_dir == "somewhere" and cli.use_vllm is True

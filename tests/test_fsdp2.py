"""FSDP2 on CPU (gloo): two sharded processes against one process and against two DDP processes, launched by
torchrun and by `accelerate launch --config_file` (an FSDP2 file); the sharded pieces checked directly
(tests/scripts/fsdp_checks.py); the options in TRL's and accelerate's forms, and DeepSpeed refused."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.fsdp import FSDPOptions, fsdp_options
from grpokit.cli import main as cli_main
from grpokit.train.checkpointer import newest_checkpoint
from grpokit.train.distcp import saved_keys
from helpers import read_jsonl
from procs import kill_after_checkpoint, run_tree

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "train_tiny.py")
# 3 steps: a reused batch (old log-probs), a sharded reference moved by TR-DPO at step 2, evaluation at step 3
COMMON = ["--max_steps", "3", "--num_iterations", "2", "--beta", "0.05", "--loss_type", "dapo", "--sync_ref_model",
          "true", "--ref_model_sync_steps", "2", "--ref_model_mixup_alpha", "0.5", "--eval", "1", "--eval_strategy",
          "steps", "--eval_steps", "3", "--per_device_eval_batch_size", "8", "--log_completions", "false"]
SHARDED = ["--fsdp", "full_shard auto_wrap"]
SAVE_AT_2 = ["--save_strategy", "steps", "--save_steps", "2"]
SAVE_EVERY = ["--save_strategy", "steps", "--save_steps", "1"]
FSDP2_YAML = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: false
  fsdp_activation_checkpointing: true
  fsdp_cpu_ram_efficient_loading: true
  fsdp_state_dict_type: FULL_STATE_DICT
mixed_precision: 'no'
num_machines: 1
num_processes: 2
machine_rank: 0
main_training_function: main
rdzv_backend: static
same_network: true
use_cpu: false
"""


def _env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    return dict(clean, OMP_NUM_THREADS="1")


def _one(args, out, timeout=200):
    result = run_tree([sys.executable, TRAIN, *args[:1], str(out), *args[1:]], timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _torchrun(script_args, timeout=200):
    # --standalone picks a free port (--master_port 0 hangs the static rendezvous)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script_args]
    return run_tree(command, timeout, env=_env())  # a hang kills launcher and workers together


def _accelerate(options, script_args, timeout=200):
    command = [sys.executable, "-m", "accelerate.commands.launch", *options, "--main_process_port", "0",
               *script_args]
    return run_tree(command, timeout, env=_env())


def _two(launch, model_dir, out, extra=()):
    result = launch([TRAIN, model_dir, str(out), "--per_device_train_batch_size", "8", *COMMON, *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _assert_same_run(a: Path, b: Path, weights="model.safetensors", atol=1e-4):
    """Same metrics rows (fp32 reduction tolerance) and final weights."""
    rows_a, rows_b = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert len(rows_a) == len(rows_b) == 4  # 3 steps and the evaluation row
    for x, y in zip(rows_a, rows_b):
        for key in ("loss", "kl", "grad_norm", "reward", "eval/loss", "eval/reward"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    wa, wb = load_file(a / weights), load_file(b / weights)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    """One process, unsharded; checkpoint-2 written whole (HF weights, optimizer.pt)."""
    return _one([tiny_model_dir, "--per_device_train_batch_size", "16", *COMMON, *SAVE_AT_2],
                tmp_path_factory.mktemp("one"))


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, tiny_model_dir):
    """Two FSDP2 processes under torchrun, a sharded checkpoint after every step."""
    return _two(_torchrun, tiny_model_dir, tmp_path_factory.mktemp("sharded") / "out", [*SHARDED, *SAVE_EVERY])


@pytest.mark.slow
def test_fsdp_under_torchrun_matches_one_process_and_ddp(tmp_path, tiny_model_dir, one_process, sharded_run):
    fsdp = sharded_run
    ddp = _two(lambda args: _accelerate(["--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                                         "--mixed_precision", "no", "--dynamo_backend", "no"], args),
               tiny_model_dir, tmp_path / "ddp")
    _assert_same_run(one_process, fsdp)
    _assert_same_run(ddp, fsdp)
    assert "lm_head.weight" not in load_file(fsdp / "model.safetensors")  # tied: saved once, as unsharded


@pytest.mark.slow
def test_accelerate_fsdp2_config_file_with_activation_checkpointing_matches_and_resumes(tmp_path, tiny_model_dir,
                                                                                       one_process):
    """reshard_after_forward false (ZeRO-2) and activation checkpointing from the file; the sharded checkpoint
    of step 2 resumes on two sharded processes to the same final model."""
    config = tmp_path / "fsdp2.yaml"
    config.write_text(FSDP2_YAML)
    launch = lambda args: _accelerate(["--config_file", str(config)], args)  # noqa: E731
    out = _two(launch, tiny_model_dir, tmp_path / "fsdp", ["--save_strategy", "steps", "--save_steps", "2"])
    _assert_same_run(one_process, out)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.symlink(out / "checkpoint-2", resumed / "checkpoint-2")
    _two(launch, tiny_model_dir, resumed, ["--resume"])
    torch.testing.assert_close(load_file(resumed / "model.safetensors"), load_file(out / "model.safetensors"),
                               rtol=0, atol=1e-6)


@pytest.mark.slow
def test_lora_on_a_sharded_base_matches_one_process(tmp_path, tiny_model_dir):
    """The adapter trains on sharded base weights; beta > 0 takes the reference with the adapter switched off;
    its sharded checkpoints resume exactly and export as an adapter folder."""
    lora = ["--lora-r", "4", "--max_steps", "2", "--beta", "0.05", "--learning_rate", "0.05"]
    one = _one([tiny_model_dir, "--per_device_train_batch_size", "16", *lora], tmp_path / "one")
    result = _torchrun([TRAIN, tiny_model_dir, str(tmp_path / "fsdp"), "--per_device_train_batch_size", "8", *lora,
                        "--fsdp", "true", *SAVE_EVERY])
    assert result.returncode == 0, result.stderr[-3000:]
    rows_one, rows_two = read_jsonl(one / "metrics.jsonl"), read_jsonl(tmp_path / "fsdp" / "metrics.jsonl")
    for x, y in zip(rows_one, rows_two):
        for key in ("loss", "kl", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), key
    a, b = load_file(one / "adapter_model.safetensors"), load_file(tmp_path / "fsdp" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-5, msg=key)
    # the sharded checkpoints hold the adapter only (the frozen base is the one the run loads) ...
    keys = saved_keys(tmp_path / "fsdp" / "checkpoint-1")
    assert any("lora_A" in k for k in keys) and not any(k.endswith("q_proj.base_layer.weight") for k in keys)
    # ... resume exactly, and export as the adapter
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.symlink(tmp_path / "fsdp" / "checkpoint-1", resumed / "checkpoint-1")
    again = _torchrun([TRAIN, tiny_model_dir, str(resumed), "--per_device_train_batch_size", "8", *lora, "--fsdp",
                       "true", "--resume"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert all(torch.equal(load_file(resumed / "adapter_model.safetensors")[k], b[k]) for k in b)
    assert cli_main(["export", str(tmp_path / "fsdp" / "checkpoint-2"), str(tmp_path / "adapter")]) == 0
    exported = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert exported.keys() == b.keys() and all(torch.equal(exported[k], b[k]) for k in b)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        tiny_model_dir
    assert not (tmp_path / "adapter" / "config.json").exists()  # else from_pretrained takes it for a whole model
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "adapter")  # the base it names, the adapter on it
    assert "default" in loaded.peft_config and any("lora_B" in name for name, _ in loaded.named_parameters())


# ---------------------------------------------------------------------- sharded checkpoints
def _resume(tmp_path, model_dir: str, checkpoint: Path, processes: int):
    """A new output_dir holding only `checkpoint`, resumed by `processes` processes (FSDP2 when more than one)
    with the same global batch; the stderr."""
    out = tmp_path / f"resumed-{processes}"
    out.mkdir()
    os.symlink(checkpoint, out / checkpoint.name)
    args = [TRAIN, model_dir, str(out), "--per_device_train_batch_size", str(16 // processes), *COMMON, "--resume"]
    if processes == 1:
        result = run_tree([sys.executable, *args], 200, env=_env())
    else:
        result = run_tree([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(processes), *args, *SHARDED], 400, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result.stderr


@pytest.mark.slow
def test_a_sharded_checkpoint_holds_each_process_shards(sharded_run):
    checkpoint = sharded_run / "checkpoint-2"
    assert sorted(p.name for p in (checkpoint / "sharded").iterdir()) == [".metadata", "__0_0.distcp",
                                                                           "__1_0.distcp"]
    assert not (checkpoint / "model.safetensors").exists() and not (checkpoint / "optimizer.pt").exists()
    keys = saved_keys(checkpoint)
    assert {"model.model.embed_tokens.weight", "optimizer.state.model.embed_tokens.weight.exp_avg",
            "reference.model.embed_tokens.weight"} <= keys  # the synced reference (sync_ref_model) too
    assert json.loads((checkpoint / "trainer_state.json").read_text())["num_processes"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2, 4])
def test_a_sharded_checkpoint_resumes_at_any_number_of_processes(tmp_path, tiny_model_dir, sharded_run, processes):
    """2 -> 2 is exact; 2 -> 1 (unsharded) and 2 -> 4 re-shard the weights and AdamW's moments and continue the
    same run to fp32 reduction tolerance (completions are seeded per sample, the global batch is the same)."""
    out, log = _resume(tmp_path, tiny_model_dir, sharded_run / "checkpoint-2", processes)
    final, expected = load_file(out / "model.safetensors"), load_file(sharded_run / "model.safetensors")
    rows, expected_rows = read_jsonl(out / "metrics.jsonl"), read_jsonl(sharded_run / "metrics.jsonl")[2:]
    assert [r["step"] for r in rows] == [r["step"] for r in expected_rows] == [3, 3]  # step 3 and its evaluation
    if processes == 2:
        assert "Re-sharded" not in log
        assert all(torch.equal(final[k], expected[k]) for k in expected)
        assert [_numbers(r) for r in rows] == [_numbers(r) for r in expected_rows]
        return
    assert f"Re-sharded {out / 'checkpoint-2'} from 2 processes to {processes}" in log
    assert f"was written by 2 processes and resumes with {processes}" in log
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=1e-6, msg=key)
    for x, y in zip(rows, expected_rows):
        for key in ("loss", "kl", "grad_norm", "reward", "eval/loss"):
            if key in y:
                assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key


def _numbers(row: dict) -> dict:
    """A metrics row without its timings and without the columns of train_tiny's --reward-sleep reward (which
    scores nothing: NaN)."""
    return {k: v for k, v in row.items()
            if k not in ("step_seconds", "tokens_per_second", "generation_seconds") and "/slow/" not in k}


@pytest.mark.slow
def test_a_whole_checkpoint_of_one_process_resumes_sharded(tmp_path, tiny_model_dir, one_process):
    """1 -> 2: HF weights and the numbered optimizer.pt of an unsharded run, read into two processes' shards."""
    out, log = _resume(tmp_path, tiny_model_dir, one_process / "checkpoint-2", 2)
    assert "was written by 1 processes and resumes with 2" in log
    final, expected = load_file(out / "model.safetensors"), load_file(one_process / "model.safetensors")
    for key in expected:
        torch.testing.assert_close(final[key], expected[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.slow
def test_kill_9_at_a_random_moment_then_resume_is_exact_sharded(tmp_path, tiny_model_dir, sharded_run):
    """Both processes and the launcher SIGKILLed at a random moment after the first checkpoint; the resumed run
    (same 2 processes) repeats the uninterrupted one exactly: every metric and every weight."""
    out = tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN,
               tiny_model_dir, str(out), "--per_device_train_batch_size", "8", *COMMON, *SHARDED, *SAVE_EVERY]
    delay, alive = kill_after_checkpoint(command + ["--reward-sleep", "0.3"], out, _env(), timeout=200)
    assert alive, f"the run finished before the kill ({delay:.2f} s after checkpoint-1)"
    newest = newest_checkpoint(out)
    result = run_tree(command + ["--resume"], 200, env=_env())
    assert result.returncode == 0, f"killed {delay:.2f} s after checkpoint-1\n{result.stderr[-3000:]}"
    assert f"Resumed from {newest} at step {newest.name.split('-')[1]}." in result.stderr
    assert [_numbers(r) for r in read_jsonl(out / "metrics.jsonl")] == \
        [_numbers(r) for r in read_jsonl(sharded_run / "metrics.jsonl")]
    final, expected = load_file(out / "model.safetensors"), load_file(sharded_run / "model.safetensors")
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)


# ---------------------------------------------------------------------- grpo export
@pytest.mark.slow
def test_grpo_export_consolidates_a_sharded_checkpoint(tmp_path, sharded_run, capsys):
    """The last step's checkpoint, exported on one process, is the run's final model, tensor for tensor, and
    loads with from_pretrained."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "exported"
    assert cli_main(["export", str(sharded_run / "checkpoint-3"), str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    exported, final = load_file(out / "model.safetensors"), load_file(sharded_run / "model.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.embed_tokens.weight, final["model.embed_tokens.weight"])
    assert AutoTokenizer.from_pretrained(out).encode("1+1=") == AutoTokenizer.from_pretrained(sharded_run).encode("1+1=")


@pytest.mark.slow
def test_grpo_export_copies_a_whole_checkpoint(tmp_path, one_process, capsys):
    out = tmp_path / "exported"
    assert cli_main(["export", str(one_process / "checkpoint-2"), str(out)]) == 0
    saved = load_file(one_process / "checkpoint-2" / "model.safetensors")
    exported = load_file(out / "model.safetensors")
    assert all(torch.equal(exported[k], saved[k]) for k in saved)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    assert cli_main(["export", str(one_process / "checkpoint-2"), str(blocked / "out")]) == 2  # before any work
    assert f"{blocked / 'out'} cannot be created: {blocked} is a file, not a folder" in capsys.readouterr().err


@pytest.mark.slow
def test_grpo_export_refuses_what_it_cannot_export(tmp_path, sharded_run, capsys):
    damaged = tmp_path / "checkpoint-2"
    shutil.copytree(sharded_run / "checkpoint-2", damaged)
    shard = damaged / "sharded" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    stateless = tmp_path / "stateless"
    shutil.copytree(sharded_run / "checkpoint-2", stateless)
    (stateless / "trainer_state.json").unlink()  # the manifest still lists it
    inside = sharded_run / "checkpoint-2" / "exported"
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [([str(damaged), str(tmp_path / "a")], f"{shard} changed since it was saved"),
             ([str(stateless), str(tmp_path / "d")], "trainer_state.json cannot be read"),
             ([str(sharded_run / "checkpoint-2"), str(inside)], "is inside the checkpoint"),
             ([str(sharded_run / "checkpoint-2"), str(sharded_run)], "is not an empty folder"),
             ([str(tmp_path / "nothing"), str(tmp_path / "b")], "is not a folder"),
             ([str(empty), str(tmp_path / "c")], "holds neither sharded weights")]
    for args, message in cases:
        assert cli_main(["export", *args]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not inside.exists() and not list(tmp_path.glob(".*export-staging"))
    latest = tmp_path / "latest"  # a link to a checkpoint, and a renamed copy, export as the folder they hold
    latest.symlink_to(sharded_run / "checkpoint-3")
    renamed = tmp_path / "step3-backup"
    shutil.copytree(sharded_run / "checkpoint-3", renamed)
    for source in (latest, renamed):
        assert cli_main(["export", str(source), str(tmp_path / f"from-{source.name}")]) == 0
        assert load_file(tmp_path / f"from-{source.name}" / "model.safetensors").keys() == \
            load_file(sharded_run / "model.safetensors").keys()


@pytest.mark.slow
def test_a_sharded_checkpoint_names_another_model_or_adapter_before_reading(tmp_path, tiny_model_dir, sharded_run):
    """Resumed with another model or with a PEFT adapter, a sharded checkpoint stops with one line saying which."""
    from grpokit.tiny import tiny_model_and_tokenizer

    wider, tokenizer = tiny_model_and_tokenizer(hidden_size=64, num_layers=2, seed=0)
    wider.save_pretrained(tmp_path / "wider")
    tokenizer.save_pretrained(tmp_path / "wider")
    for model, extra, message in [
            (str(tmp_path / "wider"), [], "was trained from another model: model.embed_tokens.weight is [98, 32] in "
                                          "the checkpoint and [98, 64] in this run's model"),
            (tiny_model_dir, ["--lora-r", "4", "--sync_ref_model", "false"], "holds a whole model's weights and this run trains a PEFT adapter")]:
        out = tmp_path / f"out-{len(extra)}"
        out.mkdir()
        os.symlink(sharded_run / "checkpoint-2", out / "checkpoint-2")
        result = run_tree([sys.executable, TRAIN, model, str(out), "--per_device_train_batch_size", "16", *COMMON,
                           *extra, "--resume"], 200, env=_env())
        assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


@pytest.mark.slow
def test_sharded_pieces_equal_the_unsharded_model():
    result = _torchrun([str(SCRIPTS / "fsdp_checks.py")], timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    found = json.loads(line.removeprefix("RESULTS "))
    assert found["shapes"] == {"all_dtensors": True, "q_proj": [[32, 32], [16, 32]], "embed": [[98, 32], [49, 32]]}
    generation = found["generation"]
    assert generation["longest_per_rank"] == [4, 24]  # rank 0 decoded padding in lockstep for 20 steps
    assert generation["same_tokens"] and generation["logprob_diff"] == 0.0 and generation["root_resharded"]
    training = found["training_pass"]
    assert training["logprob_diff"] < 1e-6 and training["grad_diff"] < 1e-6 and training["norm_diff"] < 1e-5
    assert training["head_grad_nonzero"]
    assert found["state_dict"] == {"gathered_equal": True, "tied_alias_shared": True, "restored_equal": True,
                                   "keys": ["lm_head.weight", "model.embed_tokens.weight"]}
    bf16 = found["bf16"]  # bf16 compute, fp32 shards and gradients
    assert bf16["logprob_diff"] < 0.05 and bf16["grad_dtype"] == bf16["param_dtype"] == "torch.float32"


# ---------------------------------------------------------------------- the options (no processes)
@pytest.mark.parametrize("fsdp, config, expected", [
    ("full_shard auto_wrap", None, FSDPOptions()),
    (True, {"fsdp_reshard_after_forward": "false", "activation_checkpointing": True},
     FSDPOptions(reshard_after_forward=False, activation_checkpointing=True)),
    (["shard_grad_op", "offload"], None, FSDPOptions(reshard_after_forward=False, offload_params=True)),
    ("full_shard", {"cpu_offload": True, "transformer_layer_cls_to_wrap": "Qwen2DecoderLayer", "use_orig_params": 1},
     FSDPOptions(offload_params=True, wrap_classes=("Qwen2DecoderLayer",))),
    ("true", '{"version": 2}', FSDPOptions()),
    (None, None, None), ("", None, None), (False, None, None),
])
def test_trl_forms_give_the_options(fsdp, config, expected):
    assert fsdp_options(fsdp, config, {}) == expected
    assert GRPOConfig(fsdp=fsdp, fsdp_config=config).fsdp == fsdp


def test_accelerate_environment_gives_the_options_and_the_config_wins():
    environ = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false",
               "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "A,B",
               "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_OFFLOAD_PARAMS": "false"}
    assert fsdp_options(None, None, environ) == FSDPOptions(False, False, True, ("A", "B"), False)
    assert fsdp_options(None, {"reshard_after_forward": True}, environ).reshard_after_forward is True


@pytest.mark.parametrize("fsdp, config, environ, message", [
    ("hybrid_shard", None, {}, "FSDP1 strategy"),
    ("full_shard", {"version": 1}, {}, "FSDP2 only"),
    (None, None, {"ACCELERATE_USE_FSDP": "true"}, "fsdp_version: 2"),
    (None, {"reshard_after_forward": False}, {}, "read only when fsdp is set"),
    ("full_shard", {"auto_wrap_policy": "SIZE_BASED_WRAP"}, {}, "TRANSFORMER_BASED_WRAP"),
    ("full_shard", {"limit_all_gather": True}, {}, "unknown key"),
    (None, None, {"ACCELERATE_USE_DEEPSPEED": "true"}, "ZeRO-3 -> fsdp='full_shard auto_wrap'"),
])
def test_what_fsdp2_cannot_run_is_refused(fsdp, config, environ, message):
    with pytest.raises(ConfigError, match=message):
        fsdp_options(fsdp, config, environ)


def test_deepspeed_is_refused_with_the_fsdp2_equivalent():
    with pytest.raises(ConfigError, match="deepspeed=.*ZeRO-3 -> fsdp='full_shard auto_wrap'"):
        GRPOConfig(deepspeed="ds_zero3.json")
    with pytest.raises(ConfigError, match="fsdp='no_shard' is an FSDP1 strategy"):
        GRPOConfig(fsdp="no_shard")


def test_deepspeed_accelerate_file_fails_before_the_model_loads(monkeypatch, tmp_path, prompt_dataset):
    import grpokit.train.learner as learner
    from grpokit.trainer import GRPOTrainer

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setattr(learner, "load_policy", lambda *a: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match="asks for DeepSpeed"):
        GRPOTrainer("unused-model", lambda completions, **kw: [0.0] * len(completions),
                    GRPOConfig(output_dir=str(tmp_path)), prompt_dataset)

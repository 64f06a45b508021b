"""FSDP2 with the vLLM engines and with multi-turn episodes (tools, environments), on CPU (gloo, torchrun):

- what the engines read from a sharded policy equals the unsharded model (tests/scripts/fsdp_engine_checks.py): the
  colocate push's generator, the server's streamed safetensors file, and generation calls made a different number
  of times on each process inside one gather;
- two sharded processes with tools / an environment train as one process does (the processes make different
  numbers of generation calls, checked), without hanging;
- two sharded processes with vLLM colocate, and with a vLLM server, train as one process does: the same tokens
  come back only if every push gave the engine the trained weights;
- what stays refused is refused before the model loads.
"""

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from grpokit.config import ConfigError, GRPOConfig
from grpokit.train.fsdp import run_options
from helpers import read_jsonl
from procs import run_tree
from vllm_support import requires_vllm

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = str(SCRIPTS / "train_tiny.py")
MULTITURN = str(SCRIPTS / "train_multiturn.py")
FSDP = ["--fsdp", "full_shard auto_wrap"]
# 3 steps with a sharded reference (beta) and evaluation at step 3 (every process evaluates every row)
MULTITURN_COMMON = ["--max_steps", "3", "--beta", "0.05", "--eval_strategy", "steps", "--eval_steps", "3",
                    "--per_device_eval_batch_size", "8"]
# correction off: the loss reads only the tokens vLLM sampled and the trainer's own log-probs, so the sharded and
# the unsharded run agree to fp32 tolerance exactly when every push gave the engine the same weights
VLLM_COMMON = ["--use_vllm", "true", "--max_steps", "3", "--vllm_importance_sampling_correction", "false",
               "--log_completions", "false"]
# final weights of the vLLM runs (hidden 64): AdamW divides fp32 reduction noise by small |gradient|s, measured up to
# 1.6e-4 apart in 3 of 138,048 elements; 1e-3 is still a tenth of one step's move (learning rate 1e-2)
VLLM_WEIGHTS_ATOL = 1e-3


def _env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    return dict(clean, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # this checkout's grpokit in every process


def _one(script, args, timeout=300):
    result = run_tree([sys.executable, script, *args], timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]


def _torchrun(script, args, timeout=300):
    # --standalone picks a free port; a hang kills launcher and workers together (run_tree)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script, *args]
    result = run_tree(command, timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _assert_same_run(a: Path, b: Path, keys=("loss", "kl", "grad_norm", "reward", "eval/loss", "eval/reward"),
                     atol=1e-4):
    """Same metrics rows (fp32 reduction tolerance) and final weights."""
    rows_a, rows_b = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert len(rows_a) == len(rows_b) >= 3
    for x, y in zip(rows_a, rows_b):
        assert x.keys() == y.keys()
        for key in keys:
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-4, abs=1e-6), (key, x, y)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=0, atol=atol, msg=key)
    return rows_a


# ---------------------------------------------------------------------- the pieces, on two sharded processes
@pytest.mark.slow
def test_engine_reads_of_a_sharded_policy_equal_the_unsharded_model(tmp_path):
    result = _torchrun(str(SCRIPTS / "fsdp_engine_checks.py"), [str(tmp_path)], timeout=200)
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULTS "))
    ranks = json.loads(line.removeprefix("RESULTS "))
    equal = {"keys_equal": True, "tensors_equal": True}
    for rank, found in enumerate(ranks):
        push = found["push"]
        assert push["has_tied_head"] and push["config_written"]
        assert push["streamed"] == push["colocate_file"] == equal
        assert push["server_file"] == (equal if rank == 0 else False)  # only process 0 keeps the server's file
        generation = found["generation"]
        assert generation["calls"] == 1 + 2 * rank  # different numbers of calls inside one gather: no lockstep
        assert generation["same_tokens"] and generation["logprob_diff"] < 1e-5
        assert generation["gathered_inside"] and not generation["gathered_after"]


# ---------------------------------------------------------------------- multi-turn episodes
@pytest.fixture(scope="module")
def short_turns_model_dir(tmp_path_factory):
    """The tiny model with 29 of its 98 tokens ending a turn (generation_config eos_token_id), so that a random
    model's turns end early and episodes last several turns."""
    from grpokit.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, *range(2, 30)]
    path = tmp_path_factory.mktemp("short-turns")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _calls(out: Path, rank: int) -> list[int]:
    return json.loads((out / f"calls-{rank}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["environment", "tools"])
def test_multi_turn_under_fsdp_matches_one_process(tmp_path, short_turns_model_dir, mode):
    """Episodes gathered once per batch: the two processes make different numbers of generation calls (the
    environment: process 0's episodes end after one turn, process 1's go on) and the run matches one process."""
    extra = [f"--{mode}", "1", *MULTITURN_COMMON]
    one, two = tmp_path / "one", tmp_path / "fsdp"
    _one(MULTITURN, [short_turns_model_dir, str(one), *extra, "--per_device_train_batch_size", "16"])
    _torchrun(MULTITURN, [short_turns_model_dir, str(two), *extra, "--per_device_train_batch_size", "8", *FSDP])
    rows = _assert_same_run(one, two)
    assert rows[0]["tools/turns_mean"] > 1.5  # multi-turn episodes, not single turns
    if mode == "tools":
        assert rows[0]["tools/call_frequency"] > 0
    else:  # 3 training rounds and 2 evaluation chunks; evaluation: every process runs every row
        assert _calls(two, 0)[:3] == [1, 1, 1] and min(_calls(two, 1)[:3]) > 1
        assert _calls(two, 0)[3:] == _calls(two, 1)[3:] == _calls(one, 0)[3:]


def test_multi_turn_without_gathering_for_generation_is_refused_before_the_model_loads(monkeypatch, tmp_path,
                                                                                       tiny_model_dir, prompt_dataset):
    import grpokit.train.learner as learner
    from grpokit.trainer import GRPOTrainer
    from helpers import echo

    monkeypatch.setattr(learner, "load_models", lambda *a: pytest.fail("the model loaded"))
    args = GRPOConfig(output_dir=str(tmp_path), fsdp="full_shard auto_wrap", ds3_gather_for_generation=False,
                      num_generations=4, per_device_train_batch_size=4, max_completion_length=8)
    with pytest.raises(ConfigError, match="FSDP with tools or environments needs ds3_gather_for_generation=True"):
        GRPOTrainer(tiny_model_dir, lambda completions, **kw: [0.0] * len(completions), args, prompt_dataset,
                    tools=[echo])


def _args(**values):
    base = dict(fsdp="full_shard auto_wrap", fsdp_config=None, resolved_rollout_engine="local",
                ds3_gather_for_generation=True)
    return SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize("values, agentic, peft, message", [
    ({"resolved_rollout_engine": "mypackage.engine:factory"}, False, False, "an engine of your own"),
    ({"resolved_rollout_engine": "vllm"}, False, True, "vLLM and a PEFT adapter"),
    ({"ds3_gather_for_generation": False}, True, False, "needs ds3_gather_for_generation=True"),
])
def test_what_stays_refused_under_fsdp(values, agentic, peft, message):
    with pytest.raises(ConfigError, match=message):
        run_options(_args(**values), 2, agentic, peft)


@pytest.mark.parametrize("values, agentic, peft", [
    ({"resolved_rollout_engine": "vllm"}, True, False),  # vLLM decodes from its own copy: no gather needed
    ({"resolved_rollout_engine": "vllm", "ds3_gather_for_generation": False}, True, False),
    ({}, True, False),
    ({}, False, True),  # PEFT with the local engine
])
def test_what_now_runs_under_fsdp(values, agentic, peft):
    assert run_options(_args(**values), 2, agentic, peft) is not None


# ---------------------------------------------------------------------- vLLM
@requires_vllm
@pytest.mark.slow
def test_vllm_colocate_under_fsdp_matches_one_process(tmp_path, head32_model_dir):
    """Each process starts its own engine from the gathered weights and is pushed the trained ones after every step
    (a generator of gathered tensors)."""
    one, two = tmp_path / "one", tmp_path / "fsdp"
    _one(TRAIN, [head32_model_dir, str(one), *VLLM_COMMON, "--per_device_train_batch_size", "16"], timeout=400)
    _torchrun(TRAIN, [head32_model_dir, str(two), *VLLM_COMMON, "--per_device_train_batch_size", "8", *FSDP],
              timeout=500)
    rows = _assert_same_run(one, two, atol=VLLM_WEIGHTS_ATOL)
    assert all(row["grad_norm"] > 0 for row in rows)  # the weights moved: every push had work to do


@requires_vllm
@pytest.mark.slow
def test_vllm_server_under_fsdp_matches_one_process(tmp_path, head32_model_dir):
    """Both processes join the gathers, process 0 streams the file and calls the server; one server serves both
    runs (each pushes its own weights before its first generation)."""
    from test_vllm_server import Server

    server = Server(head32_model_dir, tmp_path / "server.log")
    try:
        options = [*VLLM_COMMON, "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1", "--vllm_server_port",
                   str(server.port), "--vllm_server_timeout", "240", "--max_completion_length", "8"]
        one, two = tmp_path / "one", tmp_path / "fsdp"
        _one(TRAIN, [head32_model_dir, str(one), *options, "--per_device_train_batch_size", "16"], timeout=400)
        _torchrun(TRAIN, [head32_model_dir, str(two), *options, "--per_device_train_batch_size", "8", *FSDP],
                  timeout=400)
    finally:
        server.stop()
    rows = _assert_same_run(one, two, atol=VLLM_WEIGHTS_ATOL)
    assert all(row["grad_norm"] > 0 for row in rows)
    # the last push (the weights after step 2), streamed by process 0, against the unsharded run's file
    ours, theirs = (load_file(out / ".vllm-weights" / "model.safetensors") for out in (two, one))
    assert ours.keys() == theirs.keys() and "lm_head.weight" in ours  # every key: vLLM keeps its own tied head
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=VLLM_WEIGHTS_ATOL, msg=key)

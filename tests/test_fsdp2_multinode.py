"""FSDP2 across machines, on one machine: two torchrun launchers (`--nnodes 2 --nproc_per_node 1`, a c10d
rendezvous on 127.0.0.1), each the "node" of one sharded process, train the tiny model to the same metrics and
weights as one process, save a checkpoint, and two launchers again resume from it to the same final model as the
uninterrupted run. The same with two `accelerate launch --num_machines 2 --machine_rank K` launchers and an FSDP2
config file (accelerate's static rendezvous on --main_process_ip).

Each launcher runs in a session of its own under a deadline; when one of them fails, or the deadline passes, both
process trees are killed (a launcher whose peer is gone would otherwise wait in the rendezvous or a collective).
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import read_jsonl
from procs import kill_tree, run_tree
from test_fsdp2 import COMMON, _assert_same_run

ROOT = Path(__file__).resolve().parent.parent
TRAIN = str(Path(__file__).parent / "scripts" / "train_tiny.py")
SAVE = ["--save_strategy", "steps", "--save_steps", "2"]
ACCELERATE_FSDP2 = """distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_cpu_ram_efficient_loading: true
mixed_precision: 'no'
num_machines: 2
num_processes: 2
use_cpu: false
"""


def _env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    # this checkout's grpokit in the workers, whatever an editable install elsewhere points at
    path = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return dict(clean, OMP_NUM_THREADS="1", PYTHONPATH=path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(port: int, host: bool, script_args: list[str]) -> list[str]:
    """One machine's launcher: 1 process of a 2-machine job. The store lives in the launcher told is_host=1 (on
    real machines: the one whose address is the endpoint); ranks are given in the order the launchers join."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "grpokit-multinode",
            "--rdzv_conf", f"is_host={int(host)}", "--local_addr", "127.0.0.1", *script_args]


def accelerate_command(port: int, machine_rank: int, config: Path, script_args: list[str]) -> list[str]:
    """One machine's `accelerate launch`: --num_processes is the total over the machines."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_machines", "2",
            "--num_processes", "2", "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
            "--main_process_port", str(port), *script_args]


def run_nodes(script_args: list[str], timeout: float = 240, command=None) -> list[subprocess.CompletedProcess]:
    """Both launchers at once (`command(port, k)`: launcher k's command line; default torchrun's c10d form);
    returns their results. A launcher that fails gets its peer's tree killed at once; past `timeout` both trees
    are killed (AssertionError with what they wrote)."""
    port = _free_port()
    command = command or (lambda port, k: node_command(port, k == 0, script_args))
    commands = [command(port, k) for k in range(2)]
    logs = []
    processes = []
    for command in commands:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        logs.append((out, err))
        processes.append(subprocess.Popen(command, stdout=out, stderr=err, text=True, start_new_session=True,
                                          env=_env()))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in processes):
            if any(p.returncode not in (None, 0) for p in processes) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in processes:
            if p.poll() is None:
                kill_tree(p.pid)
                p.wait(timeout=30)
    results = []
    for command, p, (out, err) in zip(commands, processes, logs):
        out.seek(0), err.seek(0)
        results.append(subprocess.CompletedProcess(command, p.returncode, out.read(), err.read()))
        out.close(), err.close()
    if time.monotonic() > deadline:
        raise AssertionError(f"the launchers did not finish within {timeout} s; both trees killed.\n"
                             + "\n".join(f"node {k} stderr:\n{r.stderr[-2000:]}" for k, r in enumerate(results)))
    return results


def _two_nodes(model_dir, out: Path, extra=()) -> Path:
    _check(run_nodes([TRAIN, model_dir, str(out), "--per_device_train_batch_size", "8", *COMMON,
                      "--fsdp", "full_shard auto_wrap", *SAVE, *extra]))
    return out


def _check(results) -> None:
    for k, result in enumerate(results):
        assert result.returncode == 0, f"node {k}:\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir):
    one = tmp_path_factory.mktemp("one")
    result = run_tree([sys.executable, TRAIN, tiny_model_dir, str(one), "--per_device_train_batch_size", "16",
                       *COMMON], 200, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return one


@pytest.mark.slow
def test_two_launchers_train_like_one_process_and_resume(tmp_path, tiny_model_dir, one_process):
    one = one_process
    two = _two_nodes(tiny_model_dir, tmp_path / "two")
    _assert_same_run(one, two)
    assert (two / "checkpoint-2").is_dir()

    # a new run folder holding only the step-2 checkpoint: two launchers resume it and finish step 3
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    os.symlink(two / "checkpoint-2", resumed / "checkpoint-2")
    _two_nodes(tiny_model_dir, resumed, ["--resume"])
    steps = [row["step"] for row in read_jsonl(resumed / "metrics.jsonl") if "loss" in row]
    assert steps and steps[-1] == 3 and 1 not in steps  # it continued from step 2, not from the start
    final, uninterrupted = load_file(resumed / "model.safetensors"), load_file(two / "model.safetensors")
    assert final.keys() == uninterrupted.keys()
    for key in final:
        torch.testing.assert_close(final[key], uninterrupted[key], rtol=0, atol=1e-6, msg=key)
    row_two = next(r for r in read_jsonl(two / "metrics.jsonl") if r.get("step") == 3 and "loss" in r)
    row_resumed = next(r for r in read_jsonl(resumed / "metrics.jsonl") if r.get("step") == 3 and "loss" in r)
    for key in ("loss", "reward", "grad_norm"):
        assert row_resumed[key] == pytest.approx(row_two[key], rel=1e-5, abs=1e-7), key


@pytest.mark.slow
def test_two_accelerate_launchers_with_an_fsdp2_file_train_like_one_process(tmp_path, tiny_model_dir, one_process):
    config = tmp_path / "fsdp2.yaml"
    config.write_text(ACCELERATE_FSDP2)
    out = tmp_path / "two"
    script = [TRAIN, tiny_model_dir, str(out), "--per_device_train_batch_size", "8", *COMMON]
    _check(run_nodes(script, command=lambda port, k: accelerate_command(port, k, config, script)))
    _assert_same_run(one_process, out)

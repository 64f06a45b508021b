"""Server mode against a real vLLM server, started by the tests with `grpo vllm-serve` in its own session.

- the trainer waits for a server that is still starting, then every generation's log-probs agree with the
  trainer's own forward (weights pushed over the API after every optimizer step, learning rate large enough that a
  missed push would show);
- no server: a clear error after vllm_server_timeout, before any training;
- the server dies mid-run: a clear error naming the server, and the checkpoints already written stay complete.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import datasets
import pytest

from grpokit.config import GRPOConfig
from grpokit.rollout.engine import RolloutEngineError
from helpers import frac_a, read_jsonl
from procs import kill_tree, run_tree
from vllm_support import requires_vllm

pytestmark = [requires_vllm, pytest.mark.slow]
LOGPROB_TOLERANCE = 2e-4  # as in test_rollout_engines.py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server_model_dir(head32_model_dir):
    return head32_model_dir


class Server:
    """`grpo vllm-serve` in a session of its own; stop() kills its whole tree (the API server and engine core)."""

    def __init__(self, model_dir: str, log_path) -> None:
        self.port = free_port()
        self.log = open(log_path, "w")
        command = [sys.executable, "-m", "grpokit.cli", "vllm-serve", "--model", model_dir, "--host", "127.0.0.1",
                   "--port", str(self.port), "--dtype", "float32", "--max-model-len", "256", "--kv-cache-gib", "0.25"]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.process.poll() is None:
            kill_tree(self.process.pid)
        try:
            self.process.wait(timeout=30)
        finally:
            self.log.close()


@pytest.fixture
def server(server_model_dir, tmp_path):
    running = Server(server_model_dir, tmp_path / "server.log")
    yield running
    running.stop()


def dataset():
    return datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)])


def options(tmp_path, port: int, **extra) -> GRPOConfig:
    values = dict(
        output_dir=str(tmp_path / "out"), use_vllm=True, vllm_mode="server", vllm_server_host="127.0.0.1",
        vllm_server_port=port, vllm_server_timeout=180.0, num_generations=4, per_device_train_batch_size=8,
        max_completion_length=12, learning_rate=0.05, max_steps=6, logging_steps=1, disable_tqdm=True,
        log_completions=False, seed=3,
    )
    values.update(extra)
    return GRPOConfig(**values)


def test_trainer_waits_for_the_server_and_every_push_lands(server, server_model_dir, tmp_path):
    from grpokit.trainer import GRPOTrainer

    started = time.monotonic()
    trainer = GRPOTrainer(server_model_dir, [frac_a], options(tmp_path, server.port), dataset())
    waited = time.monotonic() - started
    assert waited > 2  # the server was still starting when the trainer asked
    trainer.train()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert len(rows) == 6
    for row in rows:  # step 1 and after every update at lr 0.05: the server generated with the trainer's weights
        assert row["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE, row
    assert any(row["grad_norm"] > 0 for row in rows)  # the weights moved, so every push had work to do
    trainer.engine.close()


def test_no_server_is_a_clear_error_after_the_timeout(server_model_dir, tmp_path):
    from grpokit.trainer import GRPOTrainer

    started = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"No vLLM server answered at http://127\.0\.0\.1:\d+/health within"):
        GRPOTrainer(server_model_dir, [frac_a], options(tmp_path, free_port(), vllm_server_timeout=3.0), dataset())
    assert time.monotonic() - started < 30


def test_cli_reports_a_missing_server_in_one_line(server_model_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": server_model_dir, "dataset": {"path": str(tmp_path / "d.jsonl")}, "reward_funcs": ["helpers:frac_a"],
        "use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": f"http://127.0.0.1:{free_port()}",
        "vllm_server_timeout": 2, "num_generations": 4, "per_device_train_batch_size": 8, "max_steps": 1,
        "output_dir": str(tmp_path / "out"),
    }))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(8)))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    result = run_tree([sys.executable, "-m", "grpokit.cli", "train", str(config)], timeout=120, env=env)
    assert result.returncode == 1
    assert "grpo train: error: No vLLM server answered" in result.stderr
    assert "Traceback" not in result.stderr


def test_server_dying_mid_run_is_a_clear_error_and_checkpoints_stay_whole(server, server_model_dir, tmp_path):
    from grpokit.trainer import GRPOTrainer
    from transformers import AutoModelForCausalLM

    def kill_server_at_step_3(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step == 2:  # scoring the generation for step 3: the server dies now
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(timeout=30)
        return frac_a(prompts, completions)

    args = options(tmp_path, server.port, save_strategy="steps", save_steps=1, steps_per_generation=1)
    trainer = GRPOTrainer(server_model_dir, [kill_server_at_step_3], args, dataset())
    with pytest.raises(RolloutEngineError, match="stopped answering") as failure:
        trainer.train()
    assert f"127.0.0.1:{server.port}" in str(failure.value) and "--resume" in str(failure.value)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for checkpoint in out.glob("checkpoint-*"):
        assert json.loads((checkpoint / "trainer_state.json").read_text())["trainer"]["global_step"] > 0
        AutoModelForCausalLM.from_pretrained(checkpoint)  # complete and loadable


# ---------------------------------------------------------------- asynchronous rollouts (docs/async.md)
def test_async_generation_with_a_server_pushes_each_version_once_before_it_generates(server, server_model_dir,
                                                                                       tmp_path):
    """max_staleness 1: the producer pushes the shadow's weights at each sync point, then the server generates
    with them; step 1's log-probs agree with the trainer's (same weights), later steps' are a version old."""
    from grpokit.trainer import GRPOTrainer

    trainer = GRPOTrainer(server_model_dir, [frac_a], options(tmp_path, server.port, max_staleness=1), dataset())
    producer = trainer.pipeline.collector
    events = []
    push, generate = producer.engine.sync_weights, producer.engine.generate
    producer.engine.sync_weights = lambda model, version: (events.append(("push", version)), push(model, version))[1]
    producer.engine.generate = lambda request: (events.append(("generate", producer.policy.version)),
                                                generate(request))[1]
    trainer.train()
    rows = [r for r in read_jsonl(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r["async/staleness/max"] for r in rows] == [0.0] + [1.0] * 5
    assert rows[0]["sampling/sampling_logp_difference/max"] < LOGPROB_TOLERANCE
    assert all(r["sampling/sampling_logp_difference/max"] > LOGPROB_TOLERANCE for r in rows[2:])  # a version old
    pushed = [version for kind, version in events if kind == "push"]
    generated = [version for kind, version in events if kind == "generate"]
    assert pushed == sorted(set(pushed)) and len(pushed) == len(set(generated))  # each version pushed once
    last = None
    for kind, version in events:  # a generation always reads the version pushed last
        if kind == "push":
            last = version
        else:
            assert version == last or (last is None and version == 0)
    trainer.engine.close()


def test_async_a_hung_server_stops_the_run_by_heartbeat_and_a_dead_one_with_its_error(server, server_model_dir,
                                                                                       tmp_path):
    from grpokit.trainer import GRPOTrainer
    from grpokit.train.asynchronous import GenerationStalled

    def stop_server_at_step_2(prompts, completions, trainer_state, **kwargs):
        if trainer_state.global_step == 1:  # the producer scores batch 2 (step 1's weights): the server hangs now
            os.killpg(server.process.pid, signal.SIGSTOP)
        return frac_a(prompts, completions)

    args = options(tmp_path, server.port, max_staleness=1, heartbeat_stale_after_s=5.0, save_strategy="steps",
                   save_steps=1)
    trainer = GRPOTrainer(server_model_dir, [stop_server_at_step_2], args, dataset())
    started = time.monotonic()
    with pytest.raises(GenerationStalled, match=r"heartbeat_stale_after_s=5\); it was (pushing the weights of version 2|generating 8 completions)"):
        trainer.train()
    assert time.monotonic() - started < 120
    os.killpg(server.process.pid, signal.SIGKILL)  # now dead: a resume reports the server's error
    server.process.wait(timeout=30)
    assert (tmp_path / "out" / "checkpoint-1" / "trainer_state.json").is_file()
    args = options(tmp_path, server.port, max_staleness=1, vllm_server_timeout=3.0)
    with pytest.raises(RolloutEngineError, match="No vLLM server answered"):
        GRPOTrainer(server_model_dir, [frac_a], args, dataset())

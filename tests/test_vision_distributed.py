"""Vision-language training on two processes (gloo, CPU) equals one process: DDP and FSDP2 (the vision blocks
sharded as units too), LLaVA-NeXT's never-used last vision layer under DDP, and a LoRA adapter under DDP."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpokit.tiny_vision import FAMILIES, save
from procs import run_tree

TRAIN = str(Path(__file__).parent / "scripts" / "train_vision.py")
COMMON = ["--max_steps", "3", "--beta", "0.04", "--num_iterations", "2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for name in ("qwen2_5_vl", "llava_next", "qwen2_vl"):
        model, processor = FAMILIES[name]()
        out[name] = str(save(model, processor, tmp_path_factory.mktemp(name)))
    return out


def _env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    return dict(clean, OMP_NUM_THREADS="1")


def _run(folder, out, processes, extra=(), timeout=300):
    script = [TRAIN, folder, str(out), "--per_device_train_batch_size", str(8 // processes), *COMMON, *extra]
    command = [sys.executable, *script] if processes == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]
    result = run_tree(command, timeout, env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _same(one, two, weights_file="model.safetensors"):
    rows = [[json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    keys = ("loss", "reward", "kl", "grad_norm")
    flat = [[r.get(k) for r in part for k in keys if r.get(k) is not None] for part in rows]
    assert len(flat[0]) == len(flat[1]) and flat[0] == pytest.approx(flat[1], abs=1e-5)
    a, b = load_file(str(Path(one) / weights_file)), load_file(str(Path(two) / weights_file))
    assert a.keys() == b.keys()
    # the gradient norms agree to 1e-5 above; Adam divides each gradient element by its own root mean square, so
    # rounding in a near-zero element can move that weight by up to ~lr (5e-3) a step: the weights get 2e-4
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 2e-4


@pytest.mark.parametrize("family, sharding", [("qwen2_5_vl", ()), ("qwen2_5_vl", ("--fsdp", "full_shard")),
                                              ("llava_next", ())])
def test_two_processes_equal_one(tmp_path, folders, family, sharding):
    one = _run(folders[family], tmp_path / "one", 1)
    two = _run(folders[family], tmp_path / "two", 2, sharding)
    _same(one, two)


def test_a_lora_adapter_under_ddp_equals_one_process(tmp_path, folders):
    one = _run(folders["qwen2_vl"], tmp_path / "one", 1, ("--lora-r", "4"))
    two = _run(folders["qwen2_vl"], tmp_path / "two", 2, ("--lora-r", "4"))
    _same(one, two, "adapter_model.safetensors")
    adapter = load_file(str(tmp_path / "two" / "adapter_model.safetensors"))
    assert adapter and all("language_model" in k for k in adapter)
    assert not any(torch.equal(v, torch.zeros_like(v)) for v in adapter.values())

"""Under a per-process memory limit that two DDP processes cannot train in, two FSDP2 processes train.

The limit is RLIMIT_DATA (`ulimit -d`), set on the torchrun launcher and inherited by both workers: the bytes of
a process's private writable mappings (heap, anonymous mmaps, thread stacks), which is where torch's CPU
allocator takes tensors from, and not its shared libraries or the mmapped safetensors file. A cgroup cannot be
made here (/sys/fs/cgroup is read-only), and RLIMIT_AS also counts the libraries and glibc's reserved-but-unused
arena address space (gigabytes that depend on the core count), so a limit on it measures the machine more than
the model. Past the limit an allocation fails: torch raises "DefaultCPUAllocator: can't allocate memory".

The limit derives from two things measured here, not from constants of this machine:
  B, a worker's data size when the model is negligible: the tiny test model trained the same way, unlimited,
    read from /proc/self/status at exit (tests/scripts/train_reporting_memory.py). About 1.5 GB here, most of it
    reserved thread stacks and arena space that is never touched.
  S, the fp32 bytes of the parameters of the model under test (a 201M-parameter Qwen2 at the 98-character
    vocabulary: 805 MB).
DDP needs at least B + 4 S (the parameters, their gradients and AdamW's two moments, whole in every process) and
measured B + 5.2 S at its peak (2026-11-25, this 2-core machine, VmData sampled every 0.1 s); FSDP2 over 2
processes holds 2 S of that state and measured B + 3.0 S (the whole model is loaded once before it is sharded,
and glibc keeps part of that freed memory in its arenas). The limit B + 3.9 S sits 0.9 S above FSDP2's peak and
1.3 S below DDP's, and below B + 4 S, so DDP's state alone cannot fit whatever its overheads. Generation decodes one gathered layer at a time
(ds3_gather_for_generation false) so that FSDP2's peak is its training state, not a whole gathered model; the
completions are 4 tokens and the run 2 steps (the second generates and trains with AdamW's moments in place).
"""

import json
import os
import re
import resource
import sys
from pathlib import Path

import pytest

from helpers import read_jsonl
from procs import run_tree

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(Path(__file__).parent / "scripts" / "train_reporting_memory.py")
RUN = ["--per_device_train_batch_size", "4", "--max_steps", "2", "--max_completion_length", "4", "--save_strategy",
       "no", "--ds3_gather_for_generation", "false", "--learning_rate", "1e-5"]
FSDP = ["--fsdp", "full_shard auto_wrap"]
LIMIT_IN_STATE = 3.9  # the limit: B + 3.9 S (see above)
MEMORY_FAILURE = re.compile(r"can't allocate memory|MemoryError|Cannot allocate memory|std::bad_alloc|"
                            r"out of memory|SIGKILL", re.IGNORECASE)


def _env() -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    path = os.pathsep.join(filter(None, [str(ROOT), clean.get("PYTHONPATH")]))
    return dict(clean, OMP_NUM_THREADS="1", PYTHONPATH=path)


def _torchrun(model_dir, out: Path, extra, limit: int | None = None, timeout=420):
    """Two processes of the reporting worker; with `limit`, RLIMIT_DATA (soft and hard) on the launcher and so on
    each worker. Returns the result and each rank's memory figures."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", WORKER,
               str(model_dir), str(out), *RUN, *extra]
    preexec = (lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))) if limit else None
    result = run_tree(command, timeout, env=_env(), preexec_fn=preexec)
    figures = [json.loads(x) for x in re.findall(r"MEMORY (\{[^}]*\})", result.stdout)]
    return result, sorted(figures, key=lambda f: f["rank"])


@pytest.fixture(scope="module")
def model_201m(tmp_path_factory):
    """A Qwen2 of 201M parameters (hidden 1024, 12 layers) at the character vocabulary, saved once; its fp32 bytes."""
    from grpokit.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(hidden_size=1024, num_layers=12, seed=0)
    state = sum(p.numel() * p.element_size() for p in model.parameters())
    path = tmp_path_factory.mktemp("model-201m")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path, state


@pytest.mark.slow
def test_fsdp2_trains_under_a_limit_ddp_does_not_fit(tmp_path, tiny_model_dir, model_201m):
    model_dir, state = model_201m
    result, figures = _torchrun(tiny_model_dir, tmp_path / "baseline", FSDP)
    assert result.returncode == 0 and len(figures) == 2, result.stderr[-3000:]
    baseline = max(f["data_end"] for f in figures)
    limit = int(baseline + LIMIT_IN_STATE * state)
    what = f"limit {limit / 2**30:.2f} GiB = baseline {baseline / 2**30:.2f} + {LIMIT_IN_STATE} x {state / 2**30:.2f}"

    ddp, _ = _torchrun(model_dir, tmp_path / "ddp", [], limit=limit)
    assert ddp.returncode != 0, f"DDP trained under {what}"
    assert MEMORY_FAILURE.search(ddp.stderr), f"DDP failed under {what}, but not for memory:\n{ddp.stderr[-3000:]}"

    fsdp, figures = _torchrun(model_dir, tmp_path / "fsdp", FSDP, limit=limit)
    assert fsdp.returncode == 0, f"FSDP2 failed under {what}:\n{fsdp.stderr[-3000:]}"
    steps = [row["step"] for row in read_jsonl(tmp_path / "fsdp" / "metrics.jsonl") if "loss" in row]
    assert steps == [1, 2] and (tmp_path / "fsdp" / "model.safetensors").is_file()
    assert len(figures) == 2 and all(f["data_end"] <= limit for f in figures)
    print(what, "; FSDP2 data at exit (GiB):", [round(f["data_end"] / 2**30, 2) for f in figures])

"""Prove that a refactor changed no behaviour: capture golden outputs of the code it imports, and compare captures.

    python benchmarks/equivalence.py capture OUTDIR                 # golden outputs of the grpokit it imports
    python benchmarks/equivalence.py compare GOLDEN_DIR NEW_DIR      # EQUAL, or the first difference; exit 1 on any

To capture another checkout's code (a git worktree of the commit before the refactor), put it first on the path:
`cd /tmp/base && PYTHONPATH=/tmp/base python /work/main/benchmarks/equivalence.py capture /work/golden-base`
(the multi-process runs inherit PYTHONPATH). Each run is a fresh process (or two), on the CPU, fp32 unless said,
one thread per process, fixed seeds; a capture takes a few minutes on two cores.

What a capture holds, per run (RUNS below) and per process (rankR.safetensors + rankR.json), all bit-exact:
  * every parameter's gradient at every optimizer step, cloned just before the real step runs (FSDP2: the whole
    gradient, gathered from the shards), and the names of the parameters that had none;
  * the Experience that `learner.prepare` returned for each generation batch: old / reference log-probs, mismatch
    (sampling) weights, and the ids, masks and advantages they were computed on;
  * each step's StepStats (the loss, its token-weighted metric sums, grad_norm, skipped);
  * with the recording rollout engine (RecordingEngine: the local decode loop over a copy of its own, loaded from
    every push, as vLLM holds one): sha256 of every (name, dtype, shape, bytes) the trainer gave the engine at
    each weight push, in order. Given the live nn.Module (the code before the refactor), it reads it as vLLM's
    engine does (export_weights, sharded_weights under FSDP2); given an iterator of (name, tensor), it reads that.
    It is named by its import path, except under FSDP2, which refuses any engine but "local" and "vllm": there it
    is registered in place of "vllm" and gets what vLLM's colocated engine would;
  * the run's output_dir: metrics.jsonl and completions.jsonl (byte-equal once the keys that measure time or
    memory are removed: VOLATILE_KEYS) and every saved *.safetensors (the final model or adapter, tensor by tensor).
Tensors are compared with torch.equal: no tolerance. Only public entry points are used (GRPOConfig, GRPOTrainer,
trainer.learner.optimizer / prepare / step, the rollout-engine registry's import paths), so a capture of the code
before a refactor and one after it are comparable.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCRIPT = str(Path(__file__).resolve())
FORMAT = 1  # bump when what a capture holds changes (compare refuses captures of different formats)

# ---------------------------------------------------------------------------------------------------- the runs
COMMON = {"max_steps": 2, "per_device_train_batch_size": 8, "num_generations": 4, "gradient_accumulation_steps": 1,
          "max_prompt_length": 16, "max_completion_length": 10, "learning_rate": 1e-3, "seed": 0, "logging_steps": 1,
          "save_strategy": "no", "report_to": [], "disable_tqdm": True, "use_cpu": True, "log_completions": True}
REFERENCE = {"beta": 0.04, "num_iterations": 2}  # a reference pass, and old log-probs (the batch is reused)


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run. model: "char" (char tokenizer, hidden 32, tied), "word" (the 151,936-entry word
    tokenizer, hidden 16: a head of 2.4M parameters, over FUSED_LOSS_MIN_HEAD) untied, "word-tied", or "char-lora"
    (a LoRA adapter on the char model). launcher: "python" (one process), "accelerate" (DDP on gloo) or
    "torchrun" (with the fsdp option: FSDP2 on gloo). recorded: the recording rollout engine generates, named by
    its import path ("path"), or registered in place of "vllm" ("vllm"): FSDP refuses any engine but "local" and
    "vllm", so under FSDP it takes vLLM's name and gets what vLLM's colocated engine is given."""

    name: str
    covers: str
    model: str
    options: dict
    processes: int = 1
    launcher: str = "python"
    recorded: str | None = None
    timeout: float = 240.0


RUNS = [
    Run("padded", "padded log-prob path (padding_free=False), beta>0 reference pass, num_iterations=2 old log-probs",
        "char", {**REFERENCE, "padding_free": False, "loss_type": "grpo"}),
    Run("packed", "packed path (padding_free=True, sdpa), one packed forward per micro-batch (token_budget=0), GA 2",
        "char", {**REFERENCE, "padding_free": True, "token_budget": 0, "gradient_accumulation_steps": 2,
                 "per_device_train_batch_size": 4, "loss_type": "dapo"}),
    Run("fused", "loss fused in the head (V=151,936, untied head), dL/dW summed into .grad, automatic token budget",
        "word", {**REFERENCE, "loss_type": "dapo"}),
    Run("budget", "token_budget=30: token-budgeted packed forwards regrouping a step's samples, GA 2",
        "char", {**REFERENCE, "token_budget": 30, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4,
                 "loss_type": "grpo"}),
    Run("fused-tied", "tied embedding + fused head: head dL/dW and embedding rows summed into one .grad; entropy "
        "bonus (entropy gradient); one forward per micro-batch, GA 2", "word-tied",
        {**REFERENCE, "loss_type": "bnpo", "entropy_coef": 0.01, "token_budget": 0, "gradient_accumulation_steps": 2,
         "per_device_train_batch_size": 4}),
    Run("fused-bf16", "the fused run under bf16=True autocast", "word",
        {**REFERENCE, "loss_type": "dapo", "bf16": True}),
    Run("engine", "recording engine, 1 process: weight pushes (export_weights), mismatch weights; 4 logged steps "
        "(the metrics.jsonl run)", "char", {"max_steps": 4, "beta": 0.04}, recorded="path"),
    Run("async", "asynchronous rollouts (max_staleness=1): the local engine generates from the producer's shadow "
        "copy, batches of older weights (old log-probs)", "char", {"max_steps": 4, "beta": 0.04, "max_staleness": 1}),
    Run("engine-async", "recording engine under asynchronous rollouts: the shadow's weights pushed", "char",
        {"max_steps": 4, "beta": 0.04, "max_staleness": 1}, recorded="path"),
    Run("engine-lora", "recording engine, 1 process, LoRA adapter (pushes merge the adapter)", "char-lora",
        {"max_steps": 3, "beta": 0.04}, recorded="path"),
    Run("engine-ddp", "recording engine, 2 processes, DDP on gloo", "char",
        {"max_steps": 3, "beta": 0.04, "per_device_train_batch_size": 4}, processes=2, launcher="accelerate",
        recorded="path"),
    Run("engine-fsdp2", "recording engine, 2 processes, FSDP2 on gloo (pushes gathered from the shards)", "char",
        {"max_steps": 3, "beta": 0.04, "per_device_train_batch_size": 4, "fsdp": "full_shard auto_wrap"}, processes=2,
        launcher="torchrun", recorded="vllm"),
]
RUNS_BY_NAME = {run.name: run for run in RUNS}

# Removed from metrics.jsonl rows before the byte comparison: they measure wall time, so no two runs agree.
# generation_seconds / tokens_per_second: the generation's wall time and throughput; step_seconds: the step's;
# train_runtime, train_samples_per_second, train_steps_per_second: TRL's closing row (log_history); async/*_seconds
# and async/overlap: asynchronous rollouts' timings. The patterns drop any time or memory measurement a refactor may
# add (names ending _seconds or holding per_second, memory, rss or peak_): none of them is a result of training.
VOLATILE_KEYS = {"generation_seconds", "tokens_per_second", "step_seconds", "train_runtime",
                 "train_samples_per_second", "train_steps_per_second", "async/overlap"}
VOLATILE_PARTS = ("_seconds", "per_second", "memory", "rss", "peak_")


def volatile(key: str) -> bool:
    return key in VOLATILE_KEYS or any(part in key for part in VOLATILE_PARTS)


# ---------------------------------------------------------------------------------------------------- inputs
def prompts() -> list[dict[str, str]]:
    """16 prompts of 2 to 5 single-digit words ("3 6 9 =" ...): one token each under both tokenizers, with
    different lengths, so that left padding and packing have something to do."""
    return [{"prompt": " ".join(str((i * k + 1) % 10) for k in range(1, 2 + i % 4)) + " ="} for i in range(16)]


def length_reward(prompts, completions, **kwargs):
    """A reward with signal in every group: longer completions with more vowels score higher."""
    return [len(c) / 10.0 + sum(c.count(v) for v in "aeiou") / 4.0 for c in completions]


EOS_BOOST = {"char": 4.0, "word": 6.0}  # ~ln(wanted / random P(eos)): completions of 1 to max_completion_length


def build_model(kind: str):
    """(model, tokenizer) for a Run.model kind; random init from fixed seeds, sdpa attention."""
    import torch

    from grpokit.tiny import char_tokenizer, tiny_qwen2, word_tokenizer

    if kind.startswith("char"):
        tokenizer = char_tokenizer()
        model = tiny_qwen2(len(tokenizer), hidden_size=32, num_layers=2, num_heads=4, seed=0)
    else:
        tokenizer = word_tokenizer()
        model = tiny_qwen2(len(tokenizer), hidden_size=16, num_layers=1, num_heads=2, seed=1)
    if kind == "word":  # an untied head with weights of its own
        model.config.tie_word_embeddings = False
        generator = torch.Generator().manual_seed(2)
        model.lm_head.weight = torch.nn.Parameter(0.02 * torch.randn(model.lm_head.weight.shape, generator=generator))
    model.config._attn_implementation = "sdpa"
    raise_eos(model, tokenizer, EOS_BOOST[kind.split("-")[0]])
    if kind == "char-lora":
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights=False))
    return model, tokenizer


def raise_eos(model, tokenizer, boost: float) -> None:
    """Raise the head's EOS row along the mean last hidden state of the prompts, so that EOS's logit there grows
    by `boost`: a random model then ends some completions early, and the masks, packing and aggregations see
    completions of different lengths (a random head almost never samples EOS: every completion truncated)."""
    import torch

    with torch.no_grad():
        states = [model(torch.tensor([tokenizer(row["prompt"])["input_ids"]]), output_hidden_states=True)
                  .hidden_states[-1][0] for row in prompts()]
        mean = torch.cat(states).mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] += boost * mean / mean.square().sum()


# ---------------------------------------------------------------------------------------------------- the engine
SYNCS: list[dict[str, Any]] = []  # every push the recording engine received in this process
ENGINE_MODEL: dict[str, str] = {}  # "kind": the run's Run.model, which the recording engine builds its copy of


def tensor_digest(name: str, tensor) -> list:
    """[name, dtype, shape, sha256 of name, dtype, shape and the tensor's bytes]."""
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    digest = hashlib.sha256(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    digest.update(data)
    return [name, str(tensor.dtype), list(tensor.shape), digest.hexdigest()]


def pushed_tensors(weights):
    """(name, tensor) pairs from what the trainer gives sync_weights: an iterator of pairs (after the refactor), or
    the live nn.Module (before it), turned into tensors as VLLMColocateEngine.sync_weights does."""
    import torch

    if not isinstance(weights, torch.nn.Module):
        return weights
    from torch.distributed.tensor import DTensor

    from grpokit.rollout.vllm_engine import export_weights, sharded_weights

    if any(isinstance(p, DTensor) for p in weights.parameters()):
        return sharded_weights(weights)  # a collective: every process iterates it to the end
    return list(export_weights(weights).items())


class RecordingEngine:
    """An engine with weights of its own, like vLLM: a copy of the run's model (built as the policy was), which
    every push loads, and the local engine's decode loop over it; sync_weights records digests of what it is given.
    It is not "local", so the trainer pushes weights (before the first generation too: version None) and corrects
    the mismatch; generating from its own copy, never the live policy, it cannot race an asynchronous learner."""

    name = "recording"
    version = None

    def __init__(self, context) -> None:
        from grpokit.rollout.engine import resolve_engine

        self.model, _ = build_model(ENGINE_MODEL["kind"].removesuffix("-lora"))  # pushes hold the merged adapter
        changes = {"model": self.model}
        if "sharded" in {field.name for field in dataclasses.fields(context)}:
            changes["sharded"] = False  # the copy is whole even when the policy is sharded
        self.local = resolve_engine("local")(dataclasses.replace(context, **changes))

    def generate(self, request):
        return self.local.generate(request)

    def sync_weights(self, weights, version: int) -> None:
        digests, state = [], {}
        for name, tensor in pushed_tensors(weights):  # read to its end: under FSDP every process gathers in step
            digests.append(tensor_digest(name, tensor))
            state[name] = tensor.detach().to("cpu", copy=True)
        self.model.load_state_dict(state, strict=True)
        SYNCS.append({"version": version, "tensors": digests})
        self.version = version

    def close(self) -> None:
        self.local.close()


def recording_engine(context) -> RecordingEngine:
    return RecordingEngine(context)


# ---------------------------------------------------------------------------------------------------- recording
EXPERIENCE_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "loss_mask", "advantages",
                     "old_logp", "ref_logp", "sampling_weights", "sampling_logp")


class Recorder:
    """Wraps trainer.learner.optimizer.step, learner.prepare and learner.step; holds what they saw."""

    def __init__(self, trainer) -> None:
        self.trainer, self.tensors = trainer, {}
        self.info: dict[str, Any] = {"no_grad": [], "experience_none": [], "steps": []}
        learner = trainer.learner
        self._wrap(learner.optimizer, "step", self._before_optimizer_step, None)
        self._wrap(learner, "prepare", None, self._after_prepare)
        self._wrap(learner, "step", None, self._after_step)

    @staticmethod
    def _wrap(owner, name: str, before, after) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)  # keeps the marks others put on it (torch's LR scheduler marks optimizer.step)
        def wrapped(*args, **kwargs):
            if before is not None:
                before()
            result = real(*args, **kwargs)
            if after is not None:
                after(result)
            return result

        setattr(owner, name, wrapped)

    def _before_optimizer_step(self) -> None:
        """Every parameter's gradient, before the optimizer reads it (FSDP2: gathered whole, a collective that
        every process makes here in the same order)."""
        from torch.distributed.tensor import DTensor

        index = len(self.info["no_grad"]) + 1
        missing = []
        model = self.trainer.accelerator.unwrap_model(self.trainer.learner.model)
        for name, parameter in model.named_parameters():
            grad = parameter.grad
            if grad is None:
                missing.append(name)
                continue
            grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            self.tensors[f"grad/step{index}/{name}"] = grad.detach().cpu().clone()
        self.info["no_grad"].append(missing)

    def _after_prepare(self, result) -> None:
        experience = result[0]
        index = len(self.info["experience_none"]) + 1
        none = []
        for field in EXPERIENCE_FIELDS:
            value = getattr(experience, field, None)
            if value is None:
                none.append(field)
            else:
                self.tensors[f"experience/batch{index}/{field}"] = value.detach().cpu().clone()
        self.info["experience_none"].append(none)

    def _after_step(self, stats) -> None:
        index = len(self.info["steps"]) + 1
        self.tensors[f"stats/step{index}/loss"] = stats.loss.detach().cpu().clone()
        if stats.bonus is not None:
            self.tensors[f"stats/step{index}/bonus"] = stats.bonus.detach().cpu().clone()
        for key, value in stats.token_sums.items():
            self.tensors[f"stats/step{index}/token_sums/{key}"] = value.detach().cpu().clone()
        self.info["steps"].append({"grad_norm": stats.grad_norm, "skipped": stats.skipped, "entropy": stats.entropy})

    def save(self, folder: Path, rank: int) -> None:
        from safetensors.torch import save_file

        save_file(self.tensors, str(folder / f"rank{rank}.safetensors"))
        history = [{k: v for k, v in row.items() if not volatile(k)} for row in self.trainer.state.log_history]
        info = {**self.info, "syncs": SYNCS, "log_history": history}
        (folder / f"rank{rank}.json").write_text(json.dumps(info, indent=1) + "\n")


def train_run(name: str, folder: Path) -> None:
    """One process of a run (the child): train, then write this process's records into `folder`."""
    import datasets
    import torch

    torch.set_num_threads(1)
    from grpokit import GRPOConfig, GRPOTrainer

    run = RUNS_BY_NAME[name]
    ENGINE_MODEL["kind"] = run.model
    model, tokenizer = build_model(run.model)
    options = {**COMMON, **run.options, "output_dir": str(folder / "out")}
    if run.recorded == "path":
        options["rollout_engine"] = f"{__name__}:recording_engine"
    elif run.recorded == "vllm":
        from grpokit.rollout import register_rollout_engine
        from grpokit.rollout.engine import engine_names

        engine_names()  # the built-in engines are registered first: the recorder then replaces vLLM's entry
        register_rollout_engine("vllm")(recording_engine)
        options["rollout_engine"] = "vllm"
    trainer = GRPOTrainer(model=model, reward_funcs=length_reward, args=GRPOConfig(**options),
                          train_dataset=datasets.Dataset.from_list(prompts()), processing_class=tokenizer)
    recorder = Recorder(trainer)
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    recorder.save(folder, rank)


# ---------------------------------------------------------------------------------------------------- launching
def kill_tree(pid: int) -> None:
    """The test harness's kill_tree (tests/procs.py): `pid`, its descendants and their process groups (torchrun
    starts workers in sessions of their own). Imported here, in the launching process only: a run's own process
    (which may import another checkout's grpokit) never puts this checkout's tests/ on its path."""
    tests = str(Path(SCRIPT).parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from procs import kill_tree as kill

    kill(pid)


def command(run: Run, folder: Path) -> list[str]:
    child = [SCRIPT, "_run", run.name, str(folder)]
    if run.launcher == "python":
        return [sys.executable, *child]
    if run.launcher == "accelerate":  # accelerate starts CPU workers through torchrun only under --multi_gpu
        return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                str(run.processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                "--main_process_port", "0", *child]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(run.processes),
            *child]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    return env


def launch(run: Run, folder: Path) -> float:
    """Run `run` in fresh processes, in a session of their own, killed whole on a timeout; its wall time."""
    folder.mkdir(parents=True)
    started = time.monotonic()
    with open(folder / "log.txt", "w") as log:
        process = subprocess.Popen(command(run, folder), stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                   start_new_session=True)
        try:
            code = process.wait(timeout=run.timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_tree(process.pid)
            process.wait(timeout=30)
    if code != 0:
        tail = (folder / "log.txt").read_text()[-4000:]
        reason = f"timed out after {run.timeout:.0f} s" if code is None else f"exited {code}"
        raise SystemExit(f"run {run.name} {reason}:\n{tail}")
    return time.monotonic() - started


def capture(outdir: Path, only: list[str] | None) -> None:
    import torch

    import grpokit

    if outdir.exists() and any(outdir.iterdir()):
        raise SystemExit(f"{outdir} is not empty; capture into a new folder.")
    outdir.mkdir(parents=True, exist_ok=True)
    index = {"format": FORMAT, "grpokit": grpokit.__file__, "torch": torch.__version__, "runs": {}}
    started = time.monotonic()
    for run in RUNS if not only else [RUNS_BY_NAME[name] for name in only]:
        seconds = launch(run, outdir / run.name)
        index["runs"][run.name] = {"covers": run.covers, "processes": run.processes, "seconds": round(seconds, 1)}
        print(f"captured {run.name:14s} {seconds:6.1f} s  ({run.covers})", flush=True)
    index["seconds"] = round(time.monotonic() - started, 1)
    (outdir / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    print(f"capture of {grpokit.__file__} in {outdir}: {index['seconds']} s")


# ---------------------------------------------------------------------------------------------------- comparing
def first_tensor_difference(a: dict, b: dict) -> str | None:
    """None when both hold the same names and bit-equal tensors; else the first difference and how many differ."""
    import torch

    if a.keys() != b.keys():
        only_a, only_b = sorted(a.keys() - b.keys())[:5], sorted(b.keys() - a.keys())[:5]
        return f"names differ: only in golden {only_a}, only in new {only_b}"
    different = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    if not different:
        return None
    key = different[0]
    x, y = a[key], b[key]
    if x.dtype != y.dtype or x.shape != y.shape:
        what = f"{x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
    else:
        what = f"max abs diff {(x.double() - y.double()).abs().max().item():.3e}"
    return f"{key}: {what} ({len(different)} of {len(a)} tensors differ)"


def first_value_difference(a: Any, b: Any, where: str = "") -> str | None:
    """The first place two JSON values differ (floats compared exactly), or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return f"{where}: keys {sorted(set(a) ^ set(b)) or 'in another order'}"
        return next((d for k in a if (d := first_value_difference(a[k], b[k], f"{where}/{k}"))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where}: {len(a)} vs {len(b)} entries"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_value_difference(x, y, f"{where}[{i}]"))),
                    None)
    if a != b and not (is_number(a) and is_number(b) and math.isnan(a) and math.isnan(b)):  # NaN equals NaN here
        return f"{where}: {a!r} vs {b!r}" + (f" (abs diff {abs(a - b):.3e})" if is_number(a) and is_number(b) else "")
    return None


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def jsonl_text(path: Path) -> str | None:
    """A JSONL file's rows without the volatile keys, one per line, in the file's key order; None: no file."""
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return "".join(json.dumps({k: v for k, v in row.items() if not volatile(k)}) + "\n" for row in rows)


def text_difference(a: str | None, b: str | None) -> str | None:
    if a == b:
        return None
    if a is None or b is None:
        return "missing in " + ("golden" if a is None else "new")
    lines_a, lines_b = a.splitlines(), b.splitlines()
    for i, (x, y) in enumerate(zip(lines_a, lines_b)):
        if x != y:
            return f"line {i + 1}: " + (first_value_difference(json.loads(x), json.loads(y)) or "key order")
    return f"{len(lines_a)} vs {len(lines_b)} lines"


def load_tensors(path: Path, prefix: str = "") -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(path)).items() if k.startswith(prefix)} if path.is_file() else {}


def compare_rank(golden: Path, new: Path, rank_file: str) -> list[tuple[str, str | None]]:
    """(item, difference or None) for one process's records."""
    items = []
    for section in ("grad/", "experience/", "stats/"):
        a, b = load_tensors(golden / rank_file, section), load_tensors(new / rank_file, section)
        items.append((section.rstrip("/"), first_tensor_difference(a, b)))
    info_a = json.loads((golden / rank_file).with_suffix(".json").read_text())
    info_b = json.loads((new / rank_file).with_suffix(".json").read_text())
    for key in ("no_grad", "experience_none", "steps", "syncs", "log_history"):
        items.append((key, first_value_difference(info_a.get(key), info_b.get(key), key)))
    return items


def compare_outputs(golden: Path, new: Path) -> list[tuple[str, str | None]]:
    """metrics.jsonl, completions.jsonl and the saved weights in a run's output_dir."""
    items = [(name, text_difference(jsonl_text(golden / "out" / name), jsonl_text(new / "out" / name)))
             for name in ("metrics.jsonl", "completions.jsonl")]
    files = sorted({p.name for d in (golden, new) for p in (d / "out").glob("*.safetensors")})
    for name in files:
        items.append((f"out/{name}", first_tensor_difference(load_tensors(golden / "out" / name),
                                                             load_tensors(new / "out" / name))))
    return items


def compare(golden: Path, new: Path) -> int:
    index_a = json.loads((golden / "index.json").read_text())
    index_b = json.loads((new / "index.json").read_text())
    if index_a["format"] != index_b["format"]:
        raise SystemExit(f"captures of different formats ({index_a['format']} vs {index_b['format']})")
    failures = 0
    for run in index_a["runs"]:
        if run not in index_b["runs"]:
            print(f"{run}: MISSING in {new}")
            failures += 1
            continue
        ranks = sorted(p.name for p in (golden / run).glob("rank*.safetensors"))
        items = [(f"{Path(r).stem} {item}", d) for r in ranks for item, d in compare_rank(golden / run, new / run, r)]
        items += compare_outputs(golden / run, new / run)
        for item, difference in items:
            failures += difference is not None
            print(f"{run:14s} {item:28s} {'EQUAL' if difference is None else 'DIFFERENT: ' + difference}")
    print(f"{'all EQUAL' if not failures else f'{failures} item(s) DIFFERENT'} ({golden} vs {new})")
    return 1 if failures else 0


# ---------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    cap = sub.add_parser("capture", help="write golden outputs of the imported grpokit into OUTDIR")
    cap.add_argument("outdir", type=Path)
    cap.add_argument("--only", nargs="*", choices=list(RUNS_BY_NAME), help="capture only these runs")
    cmp = sub.add_parser("compare", help="compare two captures; exit 1 on any difference")
    cmp.add_argument("golden", type=Path)
    cmp.add_argument("new", type=Path)
    child = sub.add_parser("_run", help=argparse.SUPPRESS)
    child.add_argument("name")
    child.add_argument("folder", type=Path)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.mode == "capture":
        capture(args.outdir, args.only)
    elif args.mode == "compare":
        sys.exit(compare(args.golden, args.new))
    else:
        train_run(args.name, args.folder)


if __name__ == "__main__":
    main()

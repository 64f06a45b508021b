"""One benchmark run in its own process:
`python benchmarks/worker.py {grpokit|grpokit-padded|grpokit-vllm|trl|trl-defaults} MODEL_DIR WORKLOAD OUT`
(grpokit-vllm: grpokit with use_vllm=True, vLLM colocated in the training process; grpokit-padded: grpokit with
padding_free=False, the padded log-prob passes; grpokit-budget<N>: grpokit with token_budget=N, 0 for none, where
plain grpokit has the automatic budget). BENCH_TOKEN_BUDGET=N gives every grpokit run token_budget=N.

BENCH_BF16=1 runs both trainers with bf16=True (autocast; weights and optimizer fp32).

Times every optimizer step (end to end: generation, scoring, reference pass, update) in wall-clock and in process
CPU seconds (all threads; less sensitive than wall-clock to other load on a shared machine), measures the fp32
matmul peak in this process before and after training (same threads, same neighbours), and appends a JSON line
with the step durations, the peaks and this process's peak RSS. BENCH_THREADS sets torch's thread count.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from datasets import Dataset  # noqa: E402

import torch  # noqa: E402

from workloads import (  # noqa: E402
    BETA, LEARNING_RATE, WORKLOADS, ScriptedSpread, ScriptedTranscripts, Workload, count_vowels, matmul_peak_flops,
    prompts, tokenizer_for,
)


def common_options(workload: Workload) -> dict:
    """The options both trainers get: completions forced to exactly completion_length tokens (spread: scripted)."""
    return dict(
        per_device_train_batch_size=workload.completions_per_step,
        num_generations=workload.num_generations,
        max_completion_length=workload.completion_length,
        generation_kwargs=({} if workload.spread or workload.multiturn
                           else {"min_new_tokens": workload.completion_length}),
        beta=BETA,
        num_iterations=1,
        learning_rate=LEARNING_RATE,
        loss_type="dapo",
        scale_rewards="group",
        seed=0,
        bf16=os.environ.get("BENCH_BF16") == "1",
    )


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


class SpreadEngine:
    """grpokit's side of the scripted spread generation: a rollout engine (grpokit.rollout's protocol)."""

    name = "bench_spread"

    def __init__(self, context) -> None:
        self.context = context
        self.script = ScriptedSpread(context.tokenizer, context.options.max_completion_length)

    def generate(self, request):
        from grpokit.rollout.engine import pad_rollout

        return pad_rollout(self.script(request.prompt_ids), None, self.context.eos_token_ids,
                           self.context.pad_token_id)

    def sync_weights(self, weights, version):
        pass

    def close(self):
        pass


class TranscriptEngine(SpreadEngine):
    """grpokit's side of the scripted multi-turn workload: whole transcripts with their environment mask."""

    name = "bench_multiturn"

    def __init__(self, context) -> None:
        self.context = context
        self.script = ScriptedTranscripts(context.tokenizer, context.options.max_completion_length)

    def generate(self, request):
        from grpokit.rollout.engine import pad_rollout

        tokens, masks, truncated = zip(*self.script(request.prompt_ids))
        return pad_rollout(list(tokens), None, self.context.eos_token_ids, self.context.pad_token_id,
                           tool_masks=list(masks), truncated=list(truncated))


def grpokit_trainer(model_dir: str, workload: Workload, steps: int, out_dir: str, use_vllm: bool = False,
                    padding_free: bool = True):
    """The GRPOTrainer of a grpokit run (also used by profile_step.py)."""
    from grpokit import GRPOConfig, GRPOTrainer

    extra = {}
    if workload.spread:
        from grpokit.rollout import register_rollout_engine

        register_rollout_engine("bench_spread")(SpreadEngine)
        extra = dict(rollout_engine="bench_spread", vllm_importance_sampling_correction=False)
    if workload.multiturn:
        from grpokit.rollout import register_rollout_engine

        register_rollout_engine("bench_multiturn")(TranscriptEngine)
        extra = dict(rollout_engine="bench_multiturn", vllm_importance_sampling_correction=False)
    if os.environ.get("BENCH_TOKEN_BUDGET"):
        extra["token_budget"] = int(os.environ["BENCH_TOKEN_BUDGET"])
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, gradient_checkpointing=False, save_strategy="no",
        log_completions=False, disable_tqdm=True, use_vllm=use_vllm, padding_free=padding_free, **extra,
        **common_options(workload),
    )
    data = Dataset.from_dict({"prompt": prompts(workload.vocab, spread=workload.spread or workload.multiturn)})
    return GRPOTrainer(model_dir, count_vowels, args, data, processing_class=tokenizer_for(workload.vocab))


def run_grpokit(model_dir: str, workload: Workload, steps: int, out_dir: str, use_vllm: bool = False,
                padding_free: bool = True) -> list[tuple[float, float]]:
    trainer = grpokit_trainer(model_dir, workload, steps, out_dir, use_vllm, padding_free)
    ends: list[tuple[float, float]] = []
    step = trainer.learner.step

    def timed_step(*args):
        out = step(*args)
        ends.append(_clock())
        return out

    trainer.learner.step = timed_step
    ends.append(_clock())
    trainer.train()
    return ends


def run_trl(model_dir: str, workload: Workload, steps: int, out_dir: str, defaults: bool) -> list[tuple[float, float]]:
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    like_for_like = {} if defaults else dict(gradient_checkpointing=False, use_bias_correction_kl=False)
    args = GRPOConfig(
        output_dir=out_dir, max_steps=steps, use_cpu=True, report_to=[], save_strategy="no",
        disable_tqdm=True, logging_steps=steps, **like_for_like, **common_options(workload),
    )
    ends: list[tuple[float, float]] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(_clock())

    extra = {}
    if workload.multiturn:  # TRL's multi-turn hook: whole transcripts and their env_mask from rollout_func
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        tok = tokenizer_for(workload.vocab)
        transcripts = ScriptedTranscripts(tok, workload.completion_length)

        def rollout_func(batch_prompts, trainer):
            prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in batch_prompts]
            tokens, masks, _ = zip(*transcripts(prompt_ids))
            return {"prompt_ids": prompt_ids, "completion_ids": list(tokens), "logprobs": None,
                    "env_mask": list(masks)}

        extra["rollout_func"] = rollout_func
    spread_prompts = workload.spread or workload.multiturn
    trainer = GRPOTrainer(model_dir, count_vowels, args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts(workload.vocab, spread=spread_prompts)}),
                          processing_class=tokenizer_for(workload.vocab), callbacks=[StepClock()], **extra)
    if workload.spread:  # the same scripted completions as grpokit's SpreadEngine
        script = ScriptedSpread(tokenizer_for(workload.vocab), workload.completion_length)
        trainer._generate_single_turn = lambda prompt_ids, *rest, **kw: (script(prompt_ids), None)
    ends.append(_clock())
    trainer.train()
    return ends


def main() -> None:
    engine, model_dir, workload_name, out = sys.argv[1:5]
    if engine.startswith("grpokit-budget"):
        os.environ["BENCH_TOKEN_BUDGET"] = engine.removeprefix("grpokit-budget")
    warnings.filterwarnings("ignore")
    if os.environ.get("BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["BENCH_THREADS"]))
    workload = WORKLOADS[workload_name]
    steps = workload.warmup_steps + workload.measured_steps
    tokenizer_for(workload.vocab)  # built before the clock starts
    peaks = [matmul_peak_flops()]
    with tempfile.TemporaryDirectory() as out_dir:
        if engine in ("grpokit", "grpokit-vllm", "grpokit-padded") or engine.startswith("grpokit-budget"):
            marks = run_grpokit(model_dir, workload, steps, out_dir, use_vllm=engine == "grpokit-vllm",
                                padding_free=engine != "grpokit-padded")
        else:
            marks = run_trl(model_dir, workload, steps, out_dir, defaults=engine == "trl-defaults")
    peaks.append(matmul_peak_flops())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    row = {
        "engine": engine, "workload": workload_name, "threads": torch.get_num_threads(),
        "durations": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
        "cpu_seconds": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
        "warmup": workload.warmup_steps, "peak_rss_mib": peak_kib / 1024, "matmul_peak_flops": max(peaks),
        "load_average": os.getloadavg()[0],
    }
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()

"""`grpo demo --task tools`: a tiny model learns with GRPO to call a calculator tool, offline on CPU.

    run_tools_demo("outputs/demo-tools", steps=None, seed=0)

1. load the warm model shipped in grpokit/demo/tools_assets (tools_warmup.py: it can call the tool, but guesses
   under greedy decoding) and measure its greedy held-out accuracy and tool-call rate;
2. train it with GRPOTrainer(tools=[calc]) in multi-turn episodes, rewarded only for a right final answer;
3. measure both again, save the model, plot reward and tool calls per step, write summary.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM

from grpokit.config import GRPOConfig
from grpokit.demo.run import log_held_out, read_metrics, stopped_early, write_summary
from grpokit.demo.tools_task import MAX_COMPLETION_LENGTH, calc, correctness_reward, evaluate, split_problems
from grpokit.models.loading import load_tokenizer

ASSETS = Path(__file__).parent / "tools_assets"
DEFAULT_STEPS = 200

# Found by hand on a 2-core CPU (docs/demo.md): 8 prompts x 8 episodes per step, one update per generation.
TOOL_DEMO_OPTIONS = dict(
    num_generations=8,
    per_device_train_batch_size=64,
    learning_rate=5e-4,  # 1e-3 collapsed (most calls malformed by step 50)
    lr_scheduler_type="constant",
    warmup_steps=0,
    beta=0.0,
    temperature=1.0,
    max_completion_length=MAX_COMPLETION_LENGTH,
    max_prompt_length=16,
    loss_type="dapo",
    tool_call_format="compact",
    max_tool_calling_iterations=1,
    logging_steps=1,
    log_completions=True,
    completions_logging_steps=20,
    save_strategy="no",
)


# The health alarms this demo raises on a healthy run, and why (expected_alarms.json: `grpo report` shows them as
# expected). Measured (seed 0, one thread): entropy at 9% of its early level by step 21; 5-12% of the episodes of
# some 10-step windows truncated; 85% of the groups of the last 5-step windows all-equal (the alarm is at 90%).
EXPECTED_ALARMS = {
    "entropy_collapse": "the task has one right procedure (call calc with the prompt's product, copy the result), "
    "so a policy that has learned it samples almost deterministically; the held-out accuracy, not the entropy, says "
    "whether it learned.",
    "truncation": "the truncated episodes are failed copies: the tiny model miscopies some results (mostly 3-digit "
    "products), then rambles to the length limit; the reward already gives them 0, and a longer limit would not "
    "make them right.",
    "no_learning_signal": "once the model calls the calculator, most groups of 8 are all right (4-digit products) "
    "or all wrong (3-digit products, whose results the tiny model cannot copy): the task is learned as far as this "
    "model can, so the last steps teach little.",
}


def explain_health(output_dir: Path) -> str:
    """Write expected_alarms.json; the expected alarms the run raised, in words ("" when none)."""
    from grpokit.observe.health import EXPECTED_ALARMS_FILE, check_run
    from grpokit.observe.report import load_run

    (output_dir / EXPECTED_ALARMS_FILE).write_text(json.dumps(EXPECTED_ALARMS, indent=2) + "\n")
    fired = [a for a in check_run(load_run(output_dir).metrics, expected=EXPECTED_ALARMS) if a.expected]
    if not fired:
        return ""
    lines = [f"  {a.title} (step {a.step}): {a.expected}" for a in fired]
    return "\n".join(["Health alarms of this run that the demo expects (grpo report marks them so):", *lines])


def tool_demo_config(output_dir: str | Path, steps: int, seed: int, use_vllm: bool = False,
                     max_staleness: int = 0) -> GRPOConfig:
    return GRPOConfig(output_dir=str(output_dir), max_steps=steps, seed=seed, use_vllm=use_vllm,
                      max_staleness=max_staleness, **TOOL_DEMO_OPTIONS)


def run_tools_demo(output_dir: str | Path = "outputs/demo-tools", steps: int | None = None, seed: int = 0,
                   use_vllm: bool = False, max_staleness: int = 0) -> dict:
    """Train the warm model to use the calculator; returns the summary (also written to summary.json)."""
    from grpokit.trainer import GRPOTrainer  # heavy import, after argument parsing

    started = time.perf_counter()
    output_dir = Path(output_dir)
    steps = DEFAULT_STEPS if steps is None else steps
    train, held_out = split_problems()
    torch.manual_seed(seed)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(ASSETS), load_tokenizer(str(ASSETS))
    before = evaluate(model, tokenizer, held_out)
    print(f"Warm model: {before['accuracy']:.1%} of {len(held_out)} held-out products right, "
          f"calculator called in {before['tool_call_rate']:.1%} (greedy).", flush=True)

    trainer = GRPOTrainer(
        model=model, reward_funcs=correctness_reward, args=tool_demo_config(output_dir, steps, seed, use_vllm, max_staleness),
        train_dataset=Dataset.from_list([p.row() for p in train]), processing_class=tokenizer, tools=[calc],
    )
    result = trainer.train()
    trainer.engine.close()
    if result.interrupted:
        return stopped_early(result, steps, output_dir)
    train_seconds = time.perf_counter() - started
    after = evaluate(trainer.unwrapped, tokenizer, held_out)
    shown = ("accuracy", "tool_call_rate")
    log_held_out(output_dir, steps, {k: before[k] for k in shown}, {k: after[k] for k in shown})
    summary = {
        "task": "two-digit multiplication with a calculator tool (compact calls: <call>calc(a*b)</call>)",
        "held_out_problems": len(held_out),
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "accuracy_gain": after["accuracy"] - before["accuracy"],
        "tool_call_rate_before": before["tool_call_rate"],
        "tool_call_rate_after": after["tool_call_rate"],
        "accuracy_with_call_after": after["accuracy_with_call"],
        "accuracy_without_call_after": after["accuracy_without_call"],
        "steps": steps,
        "seed": seed,
        "rollout_engine": "vllm (colocate)" if use_vllm else "local",
        "max_staleness": max_staleness,
        "train_seconds": round(train_seconds, 1),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "model": str(output_dir),
        "curves": str(output_dir / "tool_curves.png"),
    }
    plot_tool_curves(output_dir / "metrics.jsonl", output_dir / "tool_curves.png", summary)
    write_summary(output_dir, summary)
    print(describe(summary), flush=True)
    note = explain_health(output_dir)
    if note:
        print(note, flush=True)
    return summary


def describe(summary: dict) -> str:
    return (
        f"GRPO with a calculator tool, {summary['steps']} steps, seed {summary['seed']}: held-out accuracy "
        f"{summary['accuracy_before']:.1%} -> {summary['accuracy_after']:.1%} "
        f"({summary['accuracy_gain'] * 100:+.1f} points), tool-call rate {summary['tool_call_rate_before']:.1%} -> "
        f"{summary['tool_call_rate_after']:.1%}, on {summary['held_out_problems']} products the model never trained "
        f"on, in {summary['wall_seconds']:.0f} s.\nModel: {summary['model']}  Curves: {summary['curves']}"
    )


def plot_tool_curves(metrics_path: str | Path, out_path: str | Path, summary: dict) -> None:
    """Per step: the batch's mean reward and tool calls per episode; beside them, greedy held-out before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, (ax_curve, ax_bars) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [2, 1]})
    ax_curve.plot(steps, [r["reward"] for r in rows], label="reward (answer right)")
    ax_curve.plot(steps, [r["tools/call_frequency"] for r in rows], label="tool calls per episode")
    ax_curve.set_xlabel("step")
    ax_curve.set_title("training batches (sampled, temperature 1)")
    ax_curve.legend()
    ax_curve.grid(alpha=0.3)
    labels = ["accuracy", "tool-call rate"]
    before = [summary["accuracy_before"], summary["tool_call_rate_before"]]
    after = [summary["accuracy_after"], summary["tool_call_rate_after"]]
    x = range(len(labels))
    ax_bars.bar([i - 0.2 for i in x], before, width=0.4, label="before GRPO")
    ax_bars.bar([i + 0.2 for i in x], after, width=0.4, label="after GRPO")
    ax_bars.set_xticks(list(x), labels)
    ax_bars.set_ylim(0, 1)
    ax_bars.set_title(f"greedy, {summary['held_out_problems']} held-out products")
    ax_bars.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)

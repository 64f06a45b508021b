"""The benchmark workloads, shared by grpokit and TRL: a random-init tiny Qwen2, a character tokenizer, a prompt
set and a cheap reward. Both trainers get the same model folder, tokenizer object, data, reward and options."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpokit.tiny import char_tokenizer, tiny_qwen2

COMPLETION_LENGTH = 64
NUM_GENERATIONS = 8
COMPLETIONS_PER_STEP = 16  # 2 prompts x 8
BETA = 0.04
LEARNING_RATE = 1e-5


@dataclass(frozen=True)
class Workload:
    name: str
    hidden_size: int
    num_layers: int
    warmup_steps: int
    measured_steps: int


WORKLOADS = {
    "small": Workload("small", hidden_size=256, num_layers=4, warmup_steps=2, measured_steps=8),
    "large": Workload("large", hidden_size=512, num_layers=8, warmup_steps=1, measured_steps=4),
}


def build_model_dir(workload: Workload, folder: Path) -> int:
    """Save the random-init model of `workload` (and its tokenizer) into folder; returns the parameter count."""
    tok = char_tokenizer()
    model = tiny_qwen2(len(tok), hidden_size=workload.hidden_size, num_layers=workload.num_layers, seed=0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def prompts(count: int = 64) -> list[str]:
    """Prompts of equal length (16 characters), so neither trainer pads them."""
    return [f"Q{i:03d}: add {i % 10}+{i % 7}=" for i in range(count)]


def count_vowels(prompts, completions, **kwargs) -> list[float]:
    """A cheap rule-based reward: the fraction of vowels in the completion."""
    return [sum(ch in "aeiou" for ch in c) / max(1, len(c)) for c in completions]


def workload_flops(params: int, prompt_tokens: int, completion_tokens: int, completions: int) -> float:
    """Model FLOPs of one optimizer step: 2PT generation + 6PT train forward/backward + 2PT reference forward."""
    tokens = completions * (prompt_tokens + completion_tokens)
    return (2 + 6 + 2) * params * tokens


def matmul_peak_flops(size: int = 2048, repeats: int = 10) -> float:
    """fp32 FLOP/s of a large torch.matmul on this machine, best of `repeats`."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best

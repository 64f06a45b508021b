"""The benchmark workloads, shared by grpokit and TRL: a random-init Qwen2, a tokenizer, a prompt set and a cheap
reward. Both trainers get the same model folder, tokenizer object, data, reward and options.

- `small`, `large`: an 80-entry character vocabulary (the first benchmarks).
- `real`: a real vocabulary, 151,936 entries (Qwen2's size) from a word-level tokenizer in which every id is a
  word, so every sampled token decodes; 43M parameters (hidden 256, 4 layers, tied embeddings: the embedding
  matrix is 39M of them), 16 completions of exactly 256 tokens per step.
- `real-L<length>-G<G>`: the same model for the growth table (completion length x group size, 2 prompts a step).
- `spread`: the real model, prompts of 32-512 tokens, completion lengths long-tailed (ScriptedSpread).
- `multiturn`: the real model, the spread prompts, each completion a transcript of 1-4 model turns with an
  environment's answer (masked out of the loss) between them (ScriptedTranscripts).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from grpokit.tiny import REAL_VOCAB_SIZE, char_tokenizer, synthetic_words, tiny_qwen2, word_tokenizer

BETA = 0.04
LEARNING_RATE = 1e-5
PROMPTS_PER_STEP = 2


@dataclass(frozen=True)
class Workload:
    name: str
    hidden_size: int
    num_layers: int
    warmup_steps: int
    measured_steps: int
    vocab: str = "char"  # "char" (80 entries) or "real" (151,936 words)
    completion_length: int = 64  # spread: the cap
    num_generations: int = 8
    spread: bool = False  # lengths drawn as described above, generation scripted
    multiturn: bool = False  # spread prompts, transcripts of several turns (ScriptedTranscripts), scripted

    @property
    def completions_per_step(self) -> int:
        return PROMPTS_PER_STEP * self.num_generations

    @property
    def model_key(self) -> tuple:
        """Workloads with the same key share one saved model folder."""
        return (self.vocab, self.hidden_size, self.num_layers)


REAL = Workload("real", hidden_size=256, num_layers=4, warmup_steps=1, measured_steps=2, vocab="real",
                completion_length=256)
WORKLOADS = {
    "small": Workload("small", hidden_size=256, num_layers=4, warmup_steps=2, measured_steps=8),
    "large": Workload("large", hidden_size=512, num_layers=8, warmup_steps=1, measured_steps=4),
    "real": REAL,
}
# The growth table: completion length at G = 8, and G at length 256 (one warm-up step, one measured).
for length, group in [(64, 8), (1024, 8), (256, 4), (256, 16)]:
    name = f"real-L{length}-G{group}"
    WORKLOADS[name] = replace(REAL, name=name, completion_length=length, num_generations=group, measured_steps=1)
GROWTH = ["real-L64-G8", "real-L1024-G8", "real-L256-G4", "real-L256-G16"]  # with `real` (L256, G8): the table
SPREAD = replace(REAL, name="spread", completion_length=1024, spread=True, warmup_steps=1, measured_steps=2)
WORKLOADS["spread"] = SPREAD
for cap in (512, 2048):
    WORKLOADS[f"spread-C{cap}"] = replace(SPREAD, name=f"spread-C{cap}", completion_length=cap)
SPREAD_GROWTH = ["spread-C512", "spread", "spread-C2048"]
WORKLOADS["multiturn"] = replace(SPREAD, name="multiturn", spread=False, multiturn=True)
SPREAD_MEDIAN, SPREAD_SIGMA = 150, 1.5  # completion lengths: exp(N(log 150, 1.5^2)), capped


@functools.lru_cache(maxsize=2)
def tokenizer_for(vocab: str):
    """The tokenizer object both trainers get (built here, not loaded: transformers would swap its class)."""
    return word_tokenizer(REAL_VOCAB_SIZE) if vocab == "real" else char_tokenizer()


def build_model_dir(workload: Workload, folder: Path) -> int:
    """Save the random-init model of `workload` (and its tokenizer) into folder; returns the parameter count."""
    tok = tokenizer_for(workload.vocab)
    model = tiny_qwen2(len(tok), hidden_size=workload.hidden_size, num_layers=workload.num_layers, seed=0,
                       max_position_embeddings=4096)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def prompts(vocab: str = "char", count: int = 64, spread: bool = False) -> list[str]:
    """Prompts of equal token length (16), so neither trainer pads them; spread: 32-512 words, log-uniform."""
    if spread:
        words = synthetic_words(200_000)[1000:]
        g = torch.Generator().manual_seed(1)
        lengths = torch.exp(torch.empty(count).uniform_(math.log(32), math.log(512), generator=g)).round().long()
        return [" ".join(words[(i * 509 + j) * 97 % len(words)] for j in range(int(n))) for i, n in
                enumerate(lengths)]
    if vocab == "real":
        words = synthetic_words(200_000)[1000:]
        return [" ".join(words[(i * 16 + j) * 97 % len(words)] for j in range(16)) for i in range(count)]
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


def prompt_seed(prompt: list[int], occurrence: int) -> int:
    """A seed from a prompt's first 64 tokens and the place of this copy in its group."""
    return (sum((k + 1) * t for k, t in enumerate(prompt[:64])) * 1_000_003 + occurrence) % 2**62


def occurrences(prompt_ids: list[list[int]]):
    """(prompt, k) for each prompt of a batch: k counts the earlier copies of the same prompt."""
    seen: dict[tuple, int] = {}
    for prompt in prompt_ids:
        key = tuple(prompt)
        seen[key] = seen.get(key, -1) + 1
        yield prompt, seen[key]


def spread_length(prompt: list[int], occurrence: int, cap: int) -> int:
    """A completion's length, drawn from the spread distribution by its prompt and its place in the group."""
    g = torch.Generator().manual_seed(prompt_seed(prompt, occurrence))
    z = float(torch.randn(1, generator=g))
    return max(1, min(cap, round(SPREAD_MEDIAN * math.exp(SPREAD_SIGMA * z))))


class ScriptedSpread:
    """Completions of the spread lengths, words drawn at random: the k-th copy of a prompt in a batch gets the
    k-th length of that prompt. A completion shorter than the cap ends with EOS; one at the cap is truncated."""

    def __init__(self, tokenizer, cap: int) -> None:
        self.eos, self.cap = tokenizer.eos_token_id, cap
        self.low = max(tokenizer.all_special_ids) + 1

    def __call__(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        out = []
        for prompt, occurrence in occurrences(prompt_ids):
            length = spread_length(prompt, occurrence, self.cap)
            g = torch.Generator().manual_seed(length * 7919 + occurrence)
            tokens = torch.randint(self.low, REAL_VOCAB_SIZE, (length,), generator=g).tolist()
            if length < self.cap:
                tokens[-1] = self.eos
            out.append(tokens)
        return out


TURN_MEDIAN, TURN_SIGMA, TURN_CAP = 60, 1.0, 384  # a model turn's length: exp(N(log 60, 1)), at most 384
ANSWER_LENGTHS = (16, 128)  # an environment answer's length, uniform


class ScriptedTranscripts:
    """Multi-turn transcripts: 1-4 model turns, each ending with EOS, and an environment's answer of 16-128
    tokens after every turn but the last; the whole transcript at most `cap` tokens (cut there: truncated).

    Returns (tokens, mask, truncated) per completion: mask 1 where the model wrote the token, 0 on an answer (TRL's
    `env_mask`, grpokit's `tool_mask`). The k-th copy of a prompt gets the k-th transcript of that prompt.
    """

    __init__ = ScriptedSpread.__init__

    def __call__(self, prompt_ids: list[list[int]]) -> list[tuple[list[int], list[int], bool]]:
        return [self.transcript(prompt, occurrence) for prompt, occurrence in occurrences(prompt_ids)]

    def transcript(self, prompt: list[int], occurrence: int) -> tuple[list[int], list[int], bool]:
        g = torch.Generator().manual_seed(prompt_seed(prompt, occurrence))
        turns = int(torch.randint(1, 5, (1,), generator=g))
        tokens: list[int] = []
        mask: list[int] = []
        for turn in range(turns):
            z = float(torch.randn(1, generator=g))
            length = max(1, min(TURN_CAP, round(TURN_MEDIAN * math.exp(TURN_SIGMA * z))))
            words = torch.randint(self.low, REAL_VOCAB_SIZE, (length,), generator=g).tolist()
            tokens += words[:-1] + [self.eos]
            mask += [1] * length
            if turn < turns - 1:
                answer = int(torch.randint(ANSWER_LENGTHS[0], ANSWER_LENGTHS[1] + 1, (1,), generator=g))
                tokens += torch.randint(self.low, REAL_VOCAB_SIZE, (answer,), generator=g).tolist()
                mask += [0] * answer
        truncated = len(tokens) > self.cap
        return tokens[: self.cap], mask[: self.cap], truncated

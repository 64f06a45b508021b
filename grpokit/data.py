"""Datasets and files -> prompt rows; chat templates; the resumable prompt sampler.

A row has a `prompt` (a string, or a list of {"role", "content"} messages rendered with the tokenizer's chat
template) and any other columns, which reach the reward functions by name.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

FILE_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


class DataError(ValueError):
    """The dataset cannot be used as given; the message says how to fix it."""


def load_dataset_spec(spec: str | dict[str, Any]) -> datasets.Dataset:
    """Load a dataset from a local JSONL/JSON/CSV/Parquet file or a `datasets` name.

    spec: a path or name, or {"path": ..., "split": "train", "name": <config>, ...} (other keys go to
    `datasets.load_dataset`). A path "reasoning_gym:<task>[,<task>...]" generates reasoning-gym tasks instead
    (grpokit/tasks/reasoning_gym.py's load_spec: other keys size, eval_size, seed, tasks, ...).
    """
    options = {"path": spec} if isinstance(spec, str) else dict(spec)
    if "path" not in options:
        raise DataError(f"dataset {spec!r} needs a 'path' (a local file or a datasets name).")
    path = str(options.pop("path"))
    split = options.pop("split", "train")
    if path.startswith("reasoning_gym:"):  # reasoning-gym's procedural tasks, generated here (docs/tasks.md)
        from grpokit.tasks.reasoning_gym import load_spec

        return load_spec(path, split, options)
    suffix = Path(path).suffix.lower()
    if suffix in FILE_LOADERS:
        if not Path(path).is_file():
            raise DataError(f"Dataset file {path!r} does not exist.")
        return datasets.load_dataset(FILE_LOADERS[suffix], data_files={split: path}, split=split, **options)
    return datasets.load_dataset(path, split=split, **options)


def is_conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompt(tokenizer, prompt: Any, chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """The text the model continues: the string itself, or the chat template with an open assistant turn
    (apply_chat_template gets `chat_template_kwargs`, e.g. {"enable_thinking": False})."""
    if isinstance(prompt, str):
        return prompt
    if is_conversational(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "The prompts are conversations (lists of messages) but the tokenizer has no chat_template; "
                "set tokenizer.chat_template or use plain-text prompts."
            )
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {}))
    raise DataError(f"A prompt must be a string or a list of {{'role', 'content'}} messages, got {type(prompt).__name__}.")


def take_rows(dataset: datasets.IterableDataset, count: int | None, name: str = "train_dataset") -> datasets.Dataset:
    """The first `count` rows of a streaming dataset (all of them when count is None), in stream order, as a
    Dataset. The trainer indexes prompts by row (exact resume, groups across processes), so it reads what a run
    needs up front: for training, the prompts max_steps consumes (a shorter stream is read whole and repeated,
    epoch after epoch, like any dataset)."""
    import itertools

    rows = list(itertools.islice(iter(dataset), count))
    if not rows:
        raise DataError(f"{name} (an IterableDataset) yielded no rows: it needs at least one prompt.")
    return datasets.Dataset.from_list(rows)


# Words an eval set's name cannot be: they are the metric names under eval/ (eval/reward, eval/rewards/<f>/mean,
# eval/metrics/<f>/mean), and a set's metrics are logged as eval/<name>/...
RESERVED_EVAL_NAMES = ("reward", "rewards", "metrics")


def eval_sets(eval_dataset: Any) -> dict[str | None, Any]:
    """eval_dataset as {name: dataset}: one dataset -> {None: it}; a DatasetDict / IterableDatasetDict / dict of
    datasets -> its named sets (metrics logged as eval/<name>/...); None -> {}."""
    if eval_dataset is None:
        return {}
    if not isinstance(eval_dataset, dict):  # DatasetDict and IterableDatasetDict are dicts
        return {None: eval_dataset}
    if not eval_dataset:
        raise DataError("eval_dataset is an empty dict; give at least one named eval set, or eval_dataset=None.")
    for name in eval_dataset:
        if not isinstance(name, str) or not name or "/" in name or name in RESERVED_EVAL_NAMES:
            raise DataError(
                f"eval set name {name!r} cannot be used: names are non-empty strings without '/', other than "
                f"{', '.join(RESERVED_EVAL_NAMES)} (metrics are logged as eval/<name>/reward)."
            )
    return dict(eval_dataset)


def check_dataset(dataset: Any, name: str = "train_dataset") -> None:
    if not isinstance(dataset, datasets.Dataset):
        raise DataError(
            f"{name} must be a datasets.Dataset or IterableDataset (e.g. Dataset.from_list(rows)), got "
            f"{type(dataset).__name__}."
        )
    if "prompt" not in dataset.column_names:
        raise DataError(
            f"{name} has no 'prompt' column (columns: {dataset.column_names}); rename yours with "
            "dataset.rename_column('question', 'prompt')."
        )
    if len(dataset) == 0:
        raise DataError(f"{name} is empty: it needs at least one prompt.")
    from grpokit.rewards.contract import RESERVED_ARGUMENTS

    clash = sorted(set(dataset.column_names) & set(RESERVED_ARGUMENTS) - {"prompt"})
    if clash:
        raise DataError(
            f"{name} has column(s) {clash}, which clash with the arguments the trainer passes to reward functions "
            f"({', '.join(RESERVED_ARGUMENTS)}); rename them, e.g. dataset.rename_column({clash[0]!r}, 'reference_{clash[0]}')."
        )


@dataclass
class SamplerState:
    epoch: int = 0
    index: int = 0


class PromptSampler:
    """An endless stream of dataset indices, epoch after epoch, the same on every process.

    Each epoch is a seeded permutation (or the natural order). `state` is all it needs to resume exactly.
    """

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.state = SamplerState()

    def _order(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            order = self._order(self.state.epoch)
            need = count - len(out)
            out.extend(order[self.state.index : self.state.index + need])
            self.state.index += need
            if self.state.index >= self.size:
                self.state = SamplerState(self.state.epoch + 1, 0)
        return out

    @property
    def epoch_progress(self) -> float:
        return self.state.epoch + self.state.index / self.size

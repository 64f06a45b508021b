"""reasoning-gym's procedural tasks as grpokit datasets, scored by reasoning-gym's own `score_answer`.

reasoning-gym (pip install grpokit[tasks]) generates questions offline from a seed (basic_arithmetic,
letter_counting, sudoku, ... ~100 tasks) and scores a model's answer to each with the task's own checker, which
may give partial credit. This module turns them into what GRPOTrainer reads:

    splits = reasoning_gym_splits(["basic_arithmetic", "leg_counting"], size=1000, eval_size=100, seed=0)
    trainer = GRPOTrainer(model, reward_funcs=ReasoningGymReward(), train_dataset=splits["train"],
                          eval_dataset=splits["eval"], args=GRPOConfig(...))

Rows (one per generated question):

    prompt     [system: the answer-format instruction, user: the question] (prompt_format="chat"), or the
               instruction and the question as one string (prompt_format="text")
    question   the question alone (for open-r1 recipes: dataset_prompt_column: question)
    answer     reasoning-gym's reference answer (a string; None for tasks whose answers are checked, not matched)
    rg_task    the task that generated the row
    rg_entry   the whole reasoning-gym entry (question, answer, metadata) as a JSON string, tuples, sets and
               non-string dict keys kept (the scorers compare them), so the row is all the reward needs
    rg_config  the task's configuration as a JSON string (some scorers read it)

Seeds: the train split is reasoning-gym's dataset for `seed`; the eval split is generated from seed + 10**9 (its
items come from random generators seeded apart from every train item's) and any eval question that is also a
train question is dropped and replaced, so the two splits share no question. Several tasks are mixed with
reasoning-gym's composite dataset (each row's task drawn by weight).

In a `grpo train` YAML the dataset is a spec whose path starts with "reasoning_gym:" (grpokit/data.py):

    dataset: {path: "reasoning_gym:basic_arithmetic,leg_counting", size: 1000, eval_size: 100, seed: 0}
    eval_dataset: {path: "reasoning_gym:basic_arithmetic,leg_counting", split: eval, size: 1000, eval_size: 100,
                   seed: 0}
    reward_funcs: [reasoning_gym]

and open-r1's `dataset_name: reasoning_gym:basic_arithmetic` with `dataset_test_split: test` works too.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import threading
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Callable, Mapping, Sequence

import datasets

from grpokit.data import DataError
from grpokit.tasks.entries import decode_entry, encode_entry

logger = logging.getLogger("grpokit.tasks")

SPEC_PREFIX = "reasoning_gym:"
TASK_COLUMN, ENTRY_COLUMN, CONFIG_COLUMN = "rg_task", "rg_entry", "rg_config"
DEFAULT_SIZE, DEFAULT_EVAL_SIZE = 1000, 100
# Train items use random generators seeded from seed .. seed + size (+ the number of tasks); eval ones start
# EVAL_SEED_OFFSET higher. Seeds stay below 2**32 (numpy's limit, which some tasks use) for any seed < MAX_SEED.
EVAL_SEED_OFFSET = 10**9
MAX_SEED = 10**9
MAX_SIZE = 10**8
TRAIN_SPLITS = ("train",)
EVAL_SPLITS = ("eval", "test", "validation")
PROMPT_FORMATS = ("chat", "text")
INSTALL_HINT = "pip install 'grpokit[tasks]' (or pip install reasoning-gym)"
SPEC_OPTIONS = ("size", "eval_size", "seed", "system_prompt", "prompt_format")
# Tasks whose rows depend on Python's string hashing (they iterate over sets), found in reasoning-gym 0.1.25 by
# generating every task under two PYTHONHASHSEED values: without a fixed PYTHONHASHSEED their rows differ from
# one process to the next (reruns, resumes, the processes of a multi-GPU run).
HASH_DEPENDENT_TASKS = frozenset({"isomorphic_strings", "knight_swap", "polynomial_multiplication", "ransom_note",
                                  "word_ladder"})


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(f"reasoning-gym tasks need the reasoning-gym package: {INSTALL_HINT}") from exc
    return reasoning_gym


def _registry() -> dict[str, tuple[type, type]]:
    _reasoning_gym()
    from reasoning_gym.factory import DATASETS

    return DATASETS


def task_names() -> list[str]:
    """Every reasoning-gym task name (its registered datasets, less the composite that mixes them)."""
    return sorted(name for name in _registry() if name != "composite")


def system_prompts() -> dict[str, str]:
    """reasoning-gym's named system prompts ("default", "DeepSeekZero", "simple", "direct", "chain_of_draft")."""
    _reasoning_gym()
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return dict(SYSTEM_PROMPTS)


# --- task specs -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One task of a dataset: its reasoning-gym name, its weight in a mixture, its config (the fields of the
    task's config dataclass, less size and seed, which the dataset sets)."""

    name: str
    weight: float = 1.0
    config: dict[str, Any] = field(default_factory=dict)


def _config_fields(name: str) -> list[str]:
    config_cls = _registry()[name][1]
    return [f.name for f in fields(config_cls)] if is_dataclass(config_cls) else []


def _check_task(spec: TaskSpec) -> TaskSpec:
    names = task_names()
    if spec.name not in names:
        close = difflib.get_close_matches(spec.name, names, n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise DataError(f"unknown reasoning-gym task {spec.name!r}.{hint} The {len(names)} tasks are listed by "
                        "grpokit.tasks.reasoning_gym.task_names().")
    weight = spec.weight
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise DataError(f"reasoning-gym task {spec.name!r}: weight {weight!r} must be a positive number.")
    if not isinstance(spec.config, Mapping):
        raise DataError(f"reasoning-gym task {spec.name!r}: config must be a mapping of its options, got "
                        f"{type(spec.config).__name__}.")
    known = _config_fields(spec.name)
    clash = sorted({"size", "seed"} & set(spec.config))
    if clash:
        raise DataError(f"reasoning-gym task {spec.name!r}: set {clash} for the whole dataset (size=, seed=), not in "
                        "the task's config.")
    unknown = sorted(set(spec.config) - set(known))
    if unknown:
        options = sorted(set(known) - {"size", "seed"})
        raise DataError(f"reasoning-gym task {spec.name!r} has no option(s) {unknown}; its options are {options}.")
    _create(spec.name, dict(spec.config), size=1, seed=0)  # the task's own validation, with a clear error
    return TaskSpec(spec.name, float(weight), dict(spec.config))


def parse_tasks(tasks: Any) -> list[TaskSpec]:
    """Task specs from the accepted forms, each checked against reasoning-gym (name, options, validation):

    "basic_arithmetic" or "basic_arithmetic,leg_counting"; a list of names and/or {name, weight, config}
    mappings; a mapping {name: None or {weight, config}}; TaskSpec objects.
    """
    if isinstance(tasks, str):
        items: list[Any] = [t.strip() for t in tasks.split(",") if t.strip()]
    elif isinstance(tasks, TaskSpec):
        items = [tasks]
    elif isinstance(tasks, Mapping):
        if "name" in tasks:
            items = [tasks]
        else:
            bad = {name: options for name, options in tasks.items() if options is not None
                   and not isinstance(options, Mapping)}
            if bad:
                raise DataError(f"reasoning-gym tasks {bad}: each task maps to nothing or to {{weight, config}}, "
                                "e.g. {'basic_arithmetic': {'weight': 2, 'config': {'max_terms': 3}}}.")
            items = [{"name": name, **dict(options or {})} for name, options in tasks.items()]
    elif isinstance(tasks, Sequence):
        items = list(tasks)
    else:
        raise DataError(f"reasoning-gym tasks {tasks!r}: give a task name, a comma-separated list of names, a list "
                        "of names or {name, weight, config} mappings, or a mapping {name: {weight, config}}.")
    if not items:
        raise DataError("no reasoning-gym task given; name at least one, e.g. 'basic_arithmetic'.")
    specs = []
    for item in items:
        if isinstance(item, str):
            spec = TaskSpec(item)
        elif isinstance(item, TaskSpec):
            spec = item
        elif isinstance(item, Mapping):
            stray = sorted(set(item) - {"name", "weight", "config"})
            if stray or not isinstance(item.get("name"), str):
                raise DataError(f"reasoning-gym task spec {dict(item)!r}: the keys are name (required), weight and "
                                f"config{f'; not {stray} (task options go under config)' if stray else ''}.")
            spec = TaskSpec(item["name"], item.get("weight", 1.0), item.get("config") or {})
        else:
            raise DataError(f"reasoning-gym task spec {item!r} is neither a name nor a {{name, weight, config}} "
                            "mapping.")
        specs.append(_check_task(spec))
    names = [s.name for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DataError(f"reasoning-gym task(s) {repeated} given more than once; give each task once (use weight "
                        "to sample one more often).")
    return specs


def _create(name: str, config: dict[str, Any], size: int, seed: int):
    """reasoning_gym.create_dataset with its errors (bad options, failed validation) as DataErrors."""
    rg = _reasoning_gym()
    try:
        return rg.create_dataset(name, size=size, seed=seed, **config)
    except (TypeError, ValueError, AssertionError) as exc:
        raise DataError(f"reasoning-gym task {name!r} rejects config {config}: {exc or type(exc).__name__}") from exc


def _generator(specs: Sequence[TaskSpec], size: int, seed: int):
    """The reasoning-gym dataset: the task's own for one task, the composite (weighted draw per row) for several."""
    if len(specs) == 1:
        return _create(specs[0].name, specs[0].config, size, seed)
    from reasoning_gym.composite import DatasetSpec

    composite = [DatasetSpec(name=s.name, weight=s.weight, config=dict(s.config)) for s in specs]
    return _create("composite", {"datasets": composite}, size, seed)


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise DataError(f"reasoning-gym {name}={value!r} must be a whole number from {low} to {high - 1}.")
    return value


# --- datasets -----------------------------------------------------------------------------------------------------


def _instruction(system_prompt: str | None) -> str | None:
    if system_prompt is None:
        return None
    if not isinstance(system_prompt, str):
        raise DataError(f"system_prompt must be a string or None, got {type(system_prompt).__name__}.")
    return system_prompts().get(system_prompt, system_prompt)


def _row(entry: dict[str, Any], task: str, config_text: str, instruction: str | None, prompt_format: str
         ) -> dict[str, Any]:
    question = str(entry["question"])
    if prompt_format == "chat":
        prompt: Any = ([{"role": "system", "content": instruction}] if instruction else []) + [
            {"role": "user", "content": question}]
    else:
        prompt = f"{instruction.rstrip()}\n\n{question}" if instruction else question
    answer = entry.get("answer")
    try:
        stored = encode_entry(entry)
    except TypeError as exc:
        raise DataError(f"reasoning-gym task {task!r}: an entry cannot be stored in a dataset: {exc}") from exc
    return {"prompt": prompt, "question": question, "answer": None if answer is None else str(answer),
            TASK_COLUMN: task, ENTRY_COLUMN: stored, CONFIG_COLUMN: config_text}


def _generate(specs: Sequence[TaskSpec], size: int, seed: int) -> list[tuple[dict[str, Any], TaskSpec]]:
    by_name = {s.name: s for s in specs}
    out = []
    for entry in _generator(specs, size, seed):
        task = entry.get("metadata", {}).get("source_dataset", specs[0].name) if len(specs) > 1 else specs[0].name
        out.append((entry, by_name[task]))
    return out


def _eval_entries(specs: Sequence[TaskSpec], eval_size: int, seed: int, train_questions: set[str]
                  ) -> list[tuple[dict[str, Any], TaskSpec]]:
    """eval_size entries generated from seed + EVAL_SEED_OFFSET, none with a train question. A generator's items
    may depend on its size (some tasks draw their whole plan up front), so it is regenerated at double the size
    until enough remain."""
    count = eval_size
    while True:
        kept = [(e, s) for e, s in _generate(specs, count, seed + EVAL_SEED_OFFSET)
                if str(e["question"]) not in train_questions]
        if len(kept) >= eval_size:
            return kept[:eval_size]
        if count >= 16 * eval_size + 64:
            raise DataError(
                f"reasoning-gym tasks {[s.name for s in specs]}: only {len(kept)} of {count} eval questions differ "
                f"from the {len(train_questions)} distinct train questions; the tasks' configs have too few distinct "
                f"questions for eval_size={eval_size} beside that train split: lower size or eval_size, or make the "
                "tasks larger (their config).")
        count *= 2


def _build(tasks: Any, splits: Sequence[str], size: int, eval_size: int, seed: int, system_prompt: str | None,
           prompt_format: str) -> dict[str, datasets.Dataset]:
    _check_int("size", size, 1, MAX_SIZE)
    _check_int("eval_size", eval_size, 0, MAX_SIZE)
    _check_int("seed", seed, 0, MAX_SEED)
    if prompt_format not in PROMPT_FORMATS:
        raise DataError(f"prompt_format={prompt_format!r}: choose one of {PROMPT_FORMATS}.")
    specs = parse_tasks(tasks)
    unstable = sorted(HASH_DEPENDENT_TASKS & {s.name for s in specs})
    if unstable and os.environ.get("PYTHONHASHSEED", "random") == "random":
        logger.warning("reasoning-gym task(s) %s generate rows that depend on Python's string hashing, which differs "
                       "between processes: set PYTHONHASHSEED=0 (in the environment, before python starts) for the "
                       "same rows on every process, rerun and resume.", unstable)
    instruction = _instruction(system_prompt)
    train = _generate(specs, size, seed)
    out: dict[str, list[tuple[dict[str, Any], TaskSpec]]] = {"train": train}
    if "eval" in splits:
        if eval_size == 0:
            raise DataError("the eval split is asked for but eval_size=0; give eval_size >= 1.")
        out["eval"] = _eval_entries(specs, eval_size, seed, {str(e["question"]) for e, _ in train})
    config_texts = {}
    for spec in specs:
        try:
            config_texts[spec.name] = encode_entry(spec.config)
        except TypeError as exc:
            raise DataError(f"reasoning-gym task {spec.name!r}: its config cannot be stored beside the rows (give "
                            f"plain values: numbers, strings, lists, mappings): {exc}") from exc
    return {name: datasets.Dataset.from_list([_row(e, s.name, config_texts[s.name], instruction, prompt_format)
                                              for e, s in out[name]])
            for name in splits}


def reasoning_gym_splits(tasks: Any, *, size: int = DEFAULT_SIZE, eval_size: int = DEFAULT_EVAL_SIZE, seed: int = 0,
                         system_prompt: str | None = "default", prompt_format: str = "chat") -> datasets.DatasetDict:
    """{"train": `size` rows, "eval": `eval_size` rows} from reasoning-gym `tasks`, no question in both.

    tasks: "basic_arithmetic", "basic_arithmetic,leg_counting", a list of names and/or {name, weight, config}
    mappings, or {name: {weight, config}} (config: the task's options, e.g. {"max_terms": 3}).
    seed: 0 <= seed < 10**9; the same arguments give the same rows.
    system_prompt: one of reasoning-gym's named prompts ("default", "DeepSeekZero", "simple", "direct",
    "chain_of_draft"), any other string (used as is), or None (no instruction); reasoning-gym's prompts ask for
    the answer inside <answer></answer>, which ReasoningGymReward reads.
    prompt_format: "chat" (a system and a user message) or "text" (instruction, blank line, question).
    """
    built = _build(tasks, ("train", "eval"), size, eval_size, seed, system_prompt, prompt_format)
    return datasets.DatasetDict(built)


def reasoning_gym_dataset(tasks: Any, *, split: str = "train", size: int = DEFAULT_SIZE,
                          eval_size: int = DEFAULT_EVAL_SIZE, seed: int = 0, system_prompt: str | None = "default",
                          prompt_format: str = "chat") -> datasets.Dataset:
    """One split of reasoning_gym_splits(...) (same arguments): split "train", or "eval" (also "test",
    "validation"). Both splits are described by the same size/eval_size/seed, so a train and an eval dataset
    built from the same arguments never share a question."""
    if split in TRAIN_SPLITS:
        return _build(tasks, ("train",), size, eval_size, seed, system_prompt, prompt_format)["train"]
    if split in EVAL_SPLITS:
        return _build(tasks, ("train", "eval"), size, eval_size, seed, system_prompt, prompt_format)["eval"]
    raise DataError(f"reasoning-gym split {split!r}: use 'train' or one of {EVAL_SPLITS} for the held-out split.")


def load_spec(path: str, split: str, options: Mapping[str, Any]) -> datasets.Dataset:
    """A dataset spec {path: "reasoning_gym:<tasks>", split, size, eval_size, seed, system_prompt, prompt_format,
    tasks} (grpokit/data.py's load_dataset_spec). <tasks> is a comma-separated list of names; a `tasks` option
    (the forms of parse_tasks, with weights and configs) replaces it."""
    try:
        _reasoning_gym()
    except ImportError as exc:  # a config error for `grpo train`, which prints it without a traceback
        raise DataError(f"dataset {path!r}: {exc}") from exc
    options = dict(options)
    unknown = sorted(set(options) - {*SPEC_OPTIONS, "tasks"})
    if unknown:
        raise DataError(f"reasoning-gym dataset spec {path!r}: unknown option(s) {unknown}; the options are "
                        f"{sorted({*SPEC_OPTIONS, 'tasks', 'split'})}.")
    names = path[len(SPEC_PREFIX):]
    tasks = options.pop("tasks", None)
    if tasks is not None and names.strip():
        raise DataError(f"reasoning-gym dataset spec {path!r} names tasks in the path and in 'tasks'; use one: "
                        "path: 'reasoning_gym:' with tasks, or the names in the path.")
    return reasoning_gym_dataset(tasks if tasks is not None else names, split=split, **options)


# --- the reward ---------------------------------------------------------------------------------------------------


class ReasoningGymReward:
    """reasoning-gym's own score for each completion's answer, in [0, 1].

        answer = extract(text) when given; else group 1 (or the whole match) of the last match of
                 answer_pattern when given; else the text inside the last <answer_tag>...</answer_tag>
                 (reasoning_gym.utils.extract_answer, stripped); answer_tag=None: the whole completion
        r      = 0.0                                     when no answer can be extracted
        r      = score_answer(answer, entry)             otherwise: the row's task's scorer (built with the row's
                                                         task config), which may give partial credit
        r      = None                                    for a row without a reasoning-gym entry (another dataset)

    A scorer that raises scores 0.0 (logged once per task). Reads the rg_task, rg_entry and rg_config columns of
    reasoning_gym_splits / reasoning_gym_dataset rows; logs each task's mean score as reasoning_gym/<task>.
    """

    def __init__(self, answer_tag: str | None = "answer", answer_pattern: str | None = None,
                 extract: Callable[[str], str | None] | None = None, log_tasks: bool = True) -> None:
        _reasoning_gym()
        if answer_pattern is not None and extract is not None:
            raise ValueError("give one way to find the answer: answer_pattern or extract (or answer_tag), not both.")
        self.answer_tag = answer_tag
        try:
            self.pattern = re.compile(answer_pattern, re.DOTALL) if answer_pattern is not None else None
        except re.error as exc:
            raise ValueError(f"answer_pattern {answer_pattern!r} is not a regular expression: {exc}") from exc
        self.extract = extract
        self.log_tasks = log_tasks
        self.__name__ = "reasoning_gym"
        self._scorers: dict[tuple[str, str], Callable[[str | None, dict[str, Any]], float]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def extract_answer(self, text: str) -> str | None:
        """The completion's answer, or None when it has none."""
        if self.extract is not None:
            return self.extract(text)
        if self.pattern is not None:
            matches = list(self.pattern.finditer(text))
            if not matches:
                return None
            last = matches[-1]
            return (last.group(1) if last.re.groups else last.group(0)).strip()
        if self.answer_tag is None:
            return text.strip() or None
        from reasoning_gym.utils import extract_answer

        return extract_answer(text, tag_name=self.answer_tag, strip=True)

    def scorer(self, task: str, config_text: str | None) -> Callable[[str | None, dict[str, Any]], float]:
        """The score_answer of `task` built with its config (cached)."""
        key = (task, config_text or "{}")
        with self._lock:
            if key not in self._scorers:
                config = decode_entry(config_text) if config_text else {}
                if task not in _registry():
                    raise ValueError(f"rg_task {task!r} is not a reasoning-gym task; the rows must come from "
                                     "grpokit.tasks.reasoning_gym.")
                self._scorers[key] = _create(task, config, size=1, seed=0).score_answer
            return self._scorers[key]

    def score(self, text: str, task: str, entry_text: str, config_text: str | None = None) -> float:
        """One completion's score (see the class docstring)."""
        answer = self.extract_answer(text)
        if answer is None:
            return 0.0
        entry = decode_entry(entry_text)
        try:
            value = float(self.scorer(task, config_text)(answer, entry))
        except Exception as exc:  # noqa: BLE001 - a checker choking on a malformed answer is a wrong answer
            if task not in self._warned:
                self._warned.add(task)
                logger.warning("reasoning-gym's %s scorer raised on answer %.80r (%s); scored 0.0 (logged once per "
                               "task)", task, answer, exc)
            return 0.0
        return min(1.0, max(0.0, value)) if math.isfinite(value) else 0.0

    def __call__(self, completions: Sequence[Any], log_metric: Callable[[str, float], None] | None = None,
                 **columns: Any) -> list[float | None]:
        from grpokit.rewards.text import completion_text

        missing = [c for c in (TASK_COLUMN, ENTRY_COLUMN) if columns.get(c) is None]
        if missing:
            available = sorted(k for k in columns if k not in ("prompts", "completion_ids", "trainer_state",
                                                                "log_extra"))
            raise ValueError(f"the reasoning_gym reward needs the column(s) {missing}, which "
                             "grpokit.tasks.reasoning_gym datasets have; this dataset has "
                             f"{available}.")
        tasks, entries = columns[TASK_COLUMN], columns[ENTRY_COLUMN]
        configs = columns.get(CONFIG_COLUMN) or [None] * len(completions)
        out: list[float | None] = []
        per_task: dict[str, list[float]] = {}
        for completion, task, entry, config in zip(completions, tasks, entries, configs):
            if task is None or entry is None:
                out.append(None)
                continue
            value = self.score(completion_text(completion), task, entry, config)
            per_task.setdefault(task, []).append(value)
            out.append(value)
        if self.log_tasks and log_metric is not None:
            for task, values in sorted(per_task.items()):
                log_metric(f"reasoning_gym/{task}", sum(values) / len(values))
        return out

"""reasoning-gym's tasks as grpokit datasets and rewards (grpokit/tasks/reasoning_gym.py): rows built by the
library for a seed, train and eval disjoint, scored by the library's own score_answer; the YAML / CLI path; a few
GRPO steps on a mixture of two tasks."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import datasets
import pytest

reasoning_gym = pytest.importorskip("reasoning_gym", reason="needs the tasks extra: pip install grpokit[tasks]")

from grpokit.data import DataError, load_dataset_spec  # noqa: E402
from grpokit.tasks.reasoning_gym import (  # noqa: E402
    EVAL_SEED_OFFSET,
    ReasoningGymReward,
    decode_entry,
    encode_entry,
    reasoning_gym_dataset,
    reasoning_gym_splits,
    system_prompts,
)
from helpers import read_jsonl  # noqa: E402


def tagged(text):
    return f"Let me think.\n<answer>{text}</answer>"


def score(reward, rows, completions):
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    return reward(completions=completions, prompts=[r["prompt"] for r in rows], **columns)


@pytest.fixture
def no_network(monkeypatch):
    """reasoning-gym generates and scores offline: any connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)


# --- datasets -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["basic_arithmetic", "word_sorting"])
@pytest.mark.usefixtures("no_network")
def test_rows_are_the_librarys_entries_for_the_seed(task):
    splits = reasoning_gym_splits(task, size=12, eval_size=4, seed=7)
    train, evaluation = splits["train"], splits["eval"]
    assert (len(train), len(evaluation)) == (12, 4)
    assert set(train.column_names) == {"prompt", "question", "answer", "rg_task", "rg_entry", "rg_config"}
    library = reasoning_gym.create_dataset(task, size=12, seed=7)
    for i, row in enumerate(train):
        entry = library[i]
        assert decode_entry(row["rg_entry"]) == entry
        assert (row["question"], row["answer"], row["rg_task"]) == (entry["question"], entry["answer"], task)
        assert row["prompt"] == [{"role": "system", "content": system_prompts()["default"]},
                                 {"role": "user", "content": entry["question"]}]
    held_out = reasoning_gym.create_dataset(task, size=4, seed=7 + EVAL_SEED_OFFSET)
    assert evaluation["question"] == [e["question"] for e in held_out]
    assert not set(train["question"]) & set(evaluation["question"])
    # same arguments, same rows; a distant seed, other questions
    assert reasoning_gym_splits(task, size=12, eval_size=4, seed=7)["train"].to_list() == train.to_list()
    assert reasoning_gym_dataset(task, split="eval", size=12, eval_size=4, seed=7).to_list() == evaluation.to_list()
    assert not set(reasoning_gym_dataset(task, size=12, seed=10**6)["question"]) & set(train["question"])
    # what docs/tasks.md warns about: reasoning-gym seeds item i with seed + i, so seed 8 is seed 7 moved by one
    assert reasoning_gym_dataset(task, size=12, seed=8)["question"][:11] == train["question"][1:]


def test_eval_questions_that_are_also_train_questions_are_replaced():
    # "Calculate a + b." with one-digit a, b: about 120 distinct questions
    small = {"basic_arithmetic": {"config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
                                             "operators": ["+"], "allow_parentheses": False}}}
    splits = reasoning_gym_splits(small, size=60, eval_size=10, seed=0)
    train_questions = set(splits["train"]["question"])
    raw = [e["question"] for e in reasoning_gym.create_dataset(
        "basic_arithmetic", size=10, seed=EVAL_SEED_OFFSET, **small["basic_arithmetic"]["config"])]
    assert set(raw) & train_questions  # the library's own eval seed repeats train questions here ...
    assert len(splits["eval"]) == 10 and not set(splits["eval"]["question"]) & train_questions  # ... none kept
    with pytest.raises(DataError, match="too few distinct"):
        reasoning_gym_splits(small, size=3000, eval_size=10, seed=0)


@pytest.mark.usefixtures("no_network")
def test_a_weighted_mixture_uses_the_composite_dataset():
    tasks = [{"name": "basic_arithmetic", "weight": 3, "config": {"max_terms": 3}}, "word_sorting"]
    train = reasoning_gym_dataset(tasks, size=40, seed=1)
    from reasoning_gym.composite import DatasetSpec

    library = reasoning_gym.create_dataset("composite", size=40, seed=1, datasets=[
        DatasetSpec("basic_arithmetic", 3, {"max_terms": 3}), DatasetSpec("word_sorting", 1, {})])
    assert [decode_entry(e) for e in train["rg_entry"]] == list(library)
    counts = {t: train["rg_task"].count(t) for t in ("basic_arithmetic", "word_sorting")}
    assert counts["basic_arithmetic"] > counts["word_sorting"] > 0 and sum(counts.values()) == 40
    arithmetic = [json.loads(c) for c, t in zip(train["rg_config"], train["rg_task"]) if t == "basic_arithmetic"]
    assert arithmetic[0] == {"max_terms": 3}


def test_plain_text_prompts_and_other_system_prompts():
    row = reasoning_gym_dataset("basic_arithmetic", size=2, seed=0, prompt_format="text")[0]
    assert row["prompt"] == f"{system_prompts()['default'].rstrip()}\n\n{row['question']}"
    row = reasoning_gym_dataset("basic_arithmetic", size=2, seed=0, prompt_format="text", system_prompt=None)[0]
    assert row["prompt"] == row["question"]
    row = reasoning_gym_dataset("basic_arithmetic", size=2, seed=0, system_prompt="Reply in <answer> tags.")[0]
    assert row["prompt"][0] == {"role": "system", "content": "Reply in <answer> tags."}
    row = reasoning_gym_dataset("basic_arithmetic", size=2, seed=0, system_prompt=None)[0]
    assert row["prompt"] == [{"role": "user", "content": row["question"]}]


def test_bad_task_names_options_and_sizes_are_clear():
    with pytest.raises(DataError, match=r"unknown reasoning-gym task 'basic_arithmetc'\. Did you mean 'basic_arithmetic'"):
        reasoning_gym_splits("basic_arithmetc", size=2, eval_size=1)
    with pytest.raises(DataError, match=r"has no option\(s\) \['max_termz'\]; its options are \['allow_negation'"):
        reasoning_gym_splits({"basic_arithmetic": {"config": {"max_termz": 3}}}, size=2, eval_size=1)
    with pytest.raises(DataError, match="rejects config .*max_terms must be >= min_terms"):
        reasoning_gym_splits({"basic_arithmetic": {"config": {"min_terms": 5, "max_terms": 2}}}, size=2, eval_size=1)
    with pytest.raises(DataError, match=r"\['seed'\] for the whole dataset"):
        reasoning_gym_splits({"basic_arithmetic": {"config": {"seed": 3}}})
    with pytest.raises(DataError, match="weight -1 must be a positive number"):
        reasoning_gym_splits([{"name": "basic_arithmetic", "weight": -1}])
    with pytest.raises(DataError, match="given more than once"):
        reasoning_gym_splits("basic_arithmetic,basic_arithmetic")
    for bad, message in [({"size": 0}, "size=0 must be a whole number from 1"),
                         ({"size": 2.5}, "size=2.5 must be a whole number"),
                         ({"seed": -1}, "seed=-1 must be a whole number from 0"),
                         ({"eval_size": 0}, "eval_size=0; give eval_size >= 1"),
                         ({"prompt_format": "json"}, "prompt_format='json': choose one of")]:
        with pytest.raises(DataError, match=message):
            reasoning_gym_splits("basic_arithmetic", **bad)
    with pytest.raises(DataError, match="split 'dev'"):
        reasoning_gym_dataset("basic_arithmetic", split="dev")


@pytest.mark.usefixtures("no_network")
def test_entries_keep_tuples_sets_and_non_string_keys():
    value = {"a": (1, [2, (3,)]), "b": {1: "x", (2, 3): {4}}, "c": frozenset({"y"}), "__rg_type__": None}
    assert decode_entry(encode_entry(value)) == value
    assert type(decode_entry(encode_entry(value))["a"]) is tuple
    # the reason: arc_agi's scorer compares the board with tuples, so plain JSON would score its own answer 0.05
    entry = reasoning_gym.create_dataset("arc_agi", size=1, seed=0)[0]
    scorer = reasoning_gym.get_score_answer_fn("arc_agi")
    assert scorer(entry["answer"], json.loads(json.dumps(entry))) == 0.05
    assert scorer(entry["answer"], decode_entry(encode_entry(entry))) == 1.0


def test_rows_do_not_depend_on_string_hashing_except_for_the_listed_tasks(caplog):
    code = textwrap.dedent("""
        import hashlib
        from grpokit.tasks.reasoning_gym import reasoning_gym_splits
        for task in ("basic_arithmetic", "word_sorting", "letter_counting", "spell_backward", "mini_sudoku",
                     "word_ladder"):
            rows = reasoning_gym_splits(task, size=6, eval_size=2, seed=3)
            text = repr([rows["train"].to_list(), rows["eval"].to_list()])
            print("row-digest", task, hashlib.sha256(text.encode()).hexdigest())
    """)
    outputs = []
    for hash_seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1"})
        assert run.returncode == 0, run.stderr[-2000:]
        digests = [line.split()[-2:] for line in run.stdout.splitlines() if "row-digest" in line]
        outputs.append(dict(digests))
    assert len(outputs[0]) == 6
    same = {task for task in outputs[0] if outputs[0][task] == outputs[1][task]}
    assert same == {"basic_arithmetic", "word_sorting", "letter_counting", "spell_backward", "mini_sudoku"}
    with caplog.at_level("WARNING", logger="grpokit.tasks"):
        reasoning_gym_dataset("word_ladder", size=2)
    assert ("PYTHONHASHSEED=0" in caplog.text) == (os.environ.get("PYTHONHASHSEED", "random") == "random")


def test_the_installed_library_is_the_one_the_extra_pins():
    from importlib.metadata import version

    assert tuple(int(p) for p in version("reasoning-gym").split(".")[:3]) >= (0, 1, 25)


def test_without_reasoning_gym_grpokit_imports_and_says_what_to_install():
    code = textwrap.dedent("""
        import sys
        sys.modules["reasoning_gym"] = None  # as if not installed
        import grpokit.rewards, grpokit.data
        from grpokit.rewards.registry import resolve_reward_funcs
        from grpokit.tasks.reasoning_gym import reasoning_gym_splits
        for attempt in (lambda: reasoning_gym_splits("basic_arithmetic"), lambda: resolve_reward_funcs(["reasoning_gym"]),
                        lambda: grpokit.data.load_dataset_spec("reasoning_gym:basic_arithmetic")):
            try:
                attempt()
            except Exception as exc:
                print(type(exc).__name__, exc)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and all("pip install 'grpokit[tasks]'" in line for line in lines), lines
    assert [line.split()[0] for line in lines] == ["ImportError", "RewardError", "DataError"]


# --- the reward ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["basic_arithmetic", "word_sorting", "mini_sudoku"])
@pytest.mark.usefixtures("no_network")
def test_the_reference_answer_scores_one_and_wrong_or_missing_answers_zero(task):
    rows = reasoning_gym_dataset(task, size=6, seed=3).to_list()
    reward = ReasoningGymReward()
    assert score(reward, rows, [tagged(r["answer"]) for r in rows]) == [1.0] * 6
    assert score(reward, rows, [r["answer"] for r in rows]) == [0.0] * 6  # right, but not inside the tags
    assert score(reward, rows, [tagged("") for r in rows]) == [0.0] * 6
    assert score(reward, rows, ["<answer>zzz</answer>"] * 6) == [0.0] * 6
    # the last tag counts; a chat completion is read as its text
    chat = [[{"role": "assistant", "content": f"<answer>zzz</answer> no: {tagged(r['answer'])}"}] for r in rows]
    assert score(reward, rows, chat) == [1.0] * 6


def test_partial_credit_is_the_tasks_own():
    reward = ReasoningGymReward()
    row = reasoning_gym_dataset("word_sorting", size=1, seed=5)[0]
    words = decode_entry(row["rg_entry"])["metadata"]["sorted_words"]
    assert len(words) >= 3
    # word_sorting: the share of words in the right place; all but the last -> (n - 1) / n
    assert score(reward, [row], [tagged(", ".join(words[:-1]))]) == [pytest.approx((len(words) - 1) / len(words))]
    row = reasoning_gym_dataset("basic_arithmetic", size=1, seed=5)[0]
    # reasoning-gym's default scorer: the reference inside a longer answer scores len(reference) / len(answer)
    answer = f"= {row['answer']}"
    assert score(reward, [row], [tagged(answer)]) == [pytest.approx(len(row["answer"]) / len(answer))]


@pytest.mark.usefixtures("no_network")
def test_the_scorer_uses_the_rows_task_config():
    # decimal_arithmetic's scorer accepts an error of one unit in the configured last decimal place: 0.05 off is
    # right with one decimal place, wrong at the default three
    from decimal import Decimal

    config = {"min_num_decimal_places": 1, "max_num_decimal_places": 1}
    rows = reasoning_gym_dataset({"decimal_arithmetic": {"config": config}}, size=6, seed=0).to_list()
    reward = ReasoningGymReward()
    assert score(reward, rows, [tagged(r["answer"]) for r in rows]) == [1.0] * 6
    off = [str(Decimal(r["answer"]) + Decimal("0.05")) for r in rows]
    assert score(reward, rows, [tagged(a) for a in off]) == [1.0] * 6
    default = reasoning_gym.get_score_answer_fn("decimal_arithmetic")
    assert [default(a, decode_entry(r["rg_entry"])) for a, r in zip(off, rows)] == [0.0] * 6


def test_answer_extraction_is_configurable_and_other_rows_do_not_apply():
    rows = reasoning_gym_dataset("basic_arithmetic", size=3, seed=0).to_list()
    by_pattern = ReasoningGymReward(answer_pattern=r"ANSWER: (\S+)")
    assert score(by_pattern, rows, [f"ANSWER: 0\nANSWER: {r['answer']}" for r in rows]) == [1.0] * 3
    assert score(by_pattern, rows, [tagged(r["answer"]) for r in rows]) == [0.0] * 3
    whole = ReasoningGymReward(answer_tag=None)
    assert score(whole, rows, [f" {r['answer']}\n" for r in rows]) == [1.0] * 3
    assert score(ReasoningGymReward(extract=lambda t: t[-len(rows[0]["answer"]):]), rows[:1],
                 [f"xyz{rows[0]['answer']}"]) == [1.0]
    with pytest.raises(ValueError, match="not both"):
        ReasoningGymReward(answer_pattern="a", extract=len)
    mixed = rows[:1] + [{**rows[1], "rg_task": None, "rg_entry": None, "rg_config": None}]
    assert score(ReasoningGymReward(), mixed, [tagged(r["answer"]) for r in mixed]) == [1.0, None]
    with pytest.raises(ValueError, match=r"needs the column\(s\) \['rg_task', 'rg_entry'\]"):
        ReasoningGymReward()(completions=["x"], prompts=["p"], answer=["1"])


def test_the_reward_is_a_builtin_name_with_options():
    from grpokit.rewards.contract import RewardError
    from grpokit.rewards.registry import resolve_reward_funcs

    funcs = resolve_reward_funcs(["reasoning_gym", {"name": "reasoning_gym", "answer_tag": "final"}])
    assert [f.name for f in funcs] == ["reasoning_gym", "reasoning_gym_2"]
    assert funcs[1].fn.answer_tag == "final"
    with pytest.raises(RewardError, match="no option"):
        resolve_reward_funcs([{"name": "reasoning_gym", "tag": "final"}])
    with pytest.raises(RewardError, match="not a regular expression"):
        resolve_reward_funcs([{"name": "reasoning_gym", "answer_pattern": "("}])


# --- YAML / CLI ---------------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_network")
def test_dataset_specs_in_a_config():
    spec = {"path": "reasoning_gym:basic_arithmetic,word_sorting", "size": 10, "eval_size": 3, "seed": 2}
    train = load_dataset_spec(spec)
    evaluation = load_dataset_spec({**spec, "split": "eval"})
    splits = reasoning_gym_splits("basic_arithmetic,word_sorting", size=10, eval_size=3, seed=2)
    assert train.to_list() == splits["train"].to_list() and evaluation.to_list() == splits["eval"].to_list()
    weighted = load_dataset_spec({"path": "reasoning_gym:", "tasks": {"word_sorting": {"weight": 2}}, "size": 3})
    assert weighted["rg_task"] == ["word_sorting"] * 3
    with pytest.raises(DataError, match=r"unknown option\(s\) \['sizes'\]"):
        load_dataset_spec({"path": "reasoning_gym:basic_arithmetic", "sizes": 3})
    with pytest.raises(DataError, match="in the path and in 'tasks'"):
        load_dataset_spec({"path": "reasoning_gym:basic_arithmetic", "tasks": ["word_sorting"]})


def test_open_r1_dataset_keys_name_a_task():
    from grpokit.recipe import prepare_dataset, recipe_run

    values, recipe = recipe_run({"dataset_name": "reasoning_gym:basic_arithmetic", "dataset_test_split": "test",
                                 "eval_strategy": "steps", "dataset_prompt_column": "question",
                                 "system_prompt": "Answer in <answer> tags."})
    train = prepare_dataset(load_dataset_spec(values["dataset"]), recipe)
    evaluation = prepare_dataset(load_dataset_spec(values["eval_dataset"]), recipe)
    assert (len(train), len(evaluation)) == (1000, 100)
    assert train[0]["prompt"] == [{"role": "system", "content": "Answer in <answer> tags."},
                                  {"role": "user", "content": train[0]["question"]}]
    assert not set(train["question"]) & set(evaluation["question"])
    from grpokit.config import ConfigError

    with pytest.raises(ConfigError, match="holds lists, not text.*'question'"):
        prepare_dataset(load_dataset_spec(values["dataset"]), {"system_prompt": "x"})


def test_grpo_train_from_yaml(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    config = tmp_path / "rg.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {tiny_model_dir}
        dataset: &tasks
          path: "reasoning_gym:"
          tasks:
            basic_arithmetic:
            word_sorting: {{weight: 1, config: {{min_words: 3, max_words: 4}}}}
          size: 16
          eval_size: 4
          seed: 0
          prompt_format: text
          system_prompt: direct
        eval_dataset:
          <<: *tasks
          split: eval
        reward_funcs:
          - name: reasoning_gym
            answer_tag: null
        output_dir: {out}
        max_steps: 2
        num_generations: 4
        per_device_train_batch_size: 8
        max_completion_length: 8
        logging_steps: 1
        disable_tqdm: true
        report_to: none
        """))
    proc = subprocess.run([sys.executable, "-m", "grpokit.cli", "train", str(config)], capture_output=True, text=True,
                          timeout=600, start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    train_rows = [r for r in rows if "rewards/reasoning_gym/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    assert all(0.0 <= r["rewards/reasoning_gym/mean"] <= 1.0 for r in train_rows)
    assert any("eval/rewards/reasoning_gym/mean" in r for r in rows)


# --- training -----------------------------------------------------------------------------------------------------


def test_grpo_trains_a_few_steps_on_a_mixture_with_its_reward(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    import torch

    from grpokit.config import GRPOConfig
    from grpokit.trainer import GRPOTrainer

    splits = reasoning_gym_splits("letter_counting,spell_backward", size=16, eval_size=4, seed=0,
                                  prompt_format="text", system_prompt=None)
    # The whole completion is the answer, so a random model's characters already earn reasoning-gym's partial
    # credit (letter_counting: the count inside a longer answer scores len(count) / len(answer); spell_backward:
    # the share of letters in place): rewards differ within groups and the policy gets a gradient.
    reward = ReasoningGymReward(answer_tag=None)
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, per_device_train_batch_size=8,
                      max_completion_length=24, learning_rate=1e-2, disable_tqdm=True, seed=0, logging_steps=1,
                      log_completions=True, report_to="none")
    trainer = GRPOTrainer(tiny_model_dir, reward, args, splits["train"], eval_dataset=splits["eval"])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    rows = read_jsonl(tmp_path / "out" / "metrics.jsonl")
    train_rows = [r for r in rows if "rewards/reasoning_gym/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(0.0 <= r["rewards/reasoning_gym/mean"] <= 1.0 for r in train_rows)
    assert any(r["rewards/reasoning_gym/mean"] > 0 and r["reward_std"] > 0 for r in train_rows)
    per_task = {k for r in train_rows for k in r if k.startswith("reasoning_gym/")}
    assert per_task == {"reasoning_gym/letter_counting", "reasoning_gym/spell_backward"}
    assert any("eval/rewards/reasoning_gym/mean" in r for r in rows)
    # every logged reward is reasoning-gym's score of that completion against its own row
    by_prompt = {r["prompt"]: r for r in splits["train"]}
    logged = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert any(item["rewards"]["reasoning_gym"] > 0 for item in logged)
    for item in logged:
        row = by_prompt[item["prompt"]]
        expected = reward.score(item["completion"], row["rg_task"], row["rg_entry"], row["rg_config"])
        assert item["rewards"]["reasoning_gym"] == pytest.approx(expected)


def test_the_yaml_examples_in_the_docs_build():
    import re
    from pathlib import Path

    import yaml

    from grpokit.config import GRPOConfig
    from grpokit.recipe import prepare_dataset, recipe_run
    from grpokit.rewards.registry import resolve_reward_funcs

    text = (Path(__file__).parent.parent / "docs" / "tasks.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)]
    assert len(blocks) == 3
    full, weighted, open_r1 = blocks
    small = {"size": 30, "eval_size": 5}  # the docs' sizes, made small
    values, _ = recipe_run(dict(full))
    train = load_dataset_spec({**values.pop("dataset"), **small})
    evaluation = load_dataset_spec({**values.pop("eval_dataset"), **small})
    assert set(train["rg_task"]) == {"basic_arithmetic", "letter_counting"} and len(evaluation) == 5
    assert not set(train["question"]) & set(evaluation["question"])
    assert [f.name for f in resolve_reward_funcs(values.pop("reward_funcs"))] == ["reasoning_gym", "tag_structure"]
    values.pop("model")
    GRPOConfig.from_dict(values)
    mixed = load_dataset_spec({**weighted["dataset"], **small})
    assert set(mixed["rg_task"]) == {"basic_arithmetic", "word_sorting"}
    assert mixed[0]["prompt"][0] == {"role": "system", "content": system_prompts()["direct"]}
    values, recipe = recipe_run({**open_r1, "eval_strategy": "steps"})
    converted = prepare_dataset(load_dataset_spec(values["eval_dataset"]), recipe)
    assert converted[0]["prompt"][0] == {"role": "system", "content": open_r1["system_prompt"]}

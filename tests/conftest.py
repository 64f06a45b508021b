"""Shared fixtures: a tiny model and tokenizer saved to disk once per session (the real from_pretrained path)."""

import os

import datasets
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from grpokit.tiny import tiny_model_and_tokenizer

    model, tokenizer = tiny_model_and_tokenizer(hidden_size=32, num_layers=2, seed=0)
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def prompt_dataset():
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "task": "math" if i % 2 else "text"} for i in range(12)]
    return datasets.Dataset.from_list(rows)

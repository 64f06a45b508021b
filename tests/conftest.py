"""Shared fixtures: a tiny model and tokenizer saved to disk once per session (the real from_pretrained path)."""

import os

import datasets
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# GRPOKIT_CUDA_TESTS_DEVICE=cpu runs the `cuda` tests on the CPU: a dry run of their own code (references, helpers,
# subprocess launch) on a machine without a GPU; the GPU-only branches they are for are not reached there.
CUDA_DRY_RUN = os.environ.get("GRPOKIT_CUDA_TESTS_DEVICE") == "cpu"


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` are skipped, with the reason, where torch sees no CUDA device."""
    import torch

    if CUDA_DRY_RUN or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
                                   "(benchmarks/gpu_check.sh runs these tests on a lent GPU)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


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


@pytest.fixture(scope="session")
def head32_model_dir(tmp_path_factory):
    """A tiny Qwen2 with head size 32 (hidden 64, 2 heads), which vLLM's CPU attention supports, saved with its
    tokenizer (a vLLM server needs the tokenizer files)."""
    from grpokit.tiny import char_tokenizer, tiny_qwen2

    tokenizer = char_tokenizer()
    model = tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, seed=11)
    path = tmp_path_factory.mktemp("head32-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)

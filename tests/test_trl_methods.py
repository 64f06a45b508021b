"""TRL's tests call some GRPOTrainer methods on a Mock(spec=GRPOTrainer) that has only an `accelerator`: those methods
must read nothing else of the trainer (TRL's tests/test_grpo_trainer.py, TestGetHighEntropyMask)."""

from unittest.mock import Mock

import torch

from grpokit import GRPOTrainer


def _mock_trainer() -> Mock:
    trainer = Mock(spec=GRPOTrainer)
    trainer.accelerator = Mock()
    trainer.accelerator.num_processes = 1
    trainer.accelerator.gather = lambda x: x
    trainer.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    return trainer


def test_get_high_entropy_mask_needs_only_the_accelerator():
    entropies = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 0.8, 0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    out = GRPOTrainer.get_high_entropy_mask(_mock_trainer(), entropies, mask, 0.5)
    # counted entropies 0.1 0.5 0.9 0.7 0.2 0.8 0.4: the 0.5 quantile is 0.5; the masked 0.3 never counts
    expected = torch.tensor([[False, True, True, False], [True, False, True, False]])
    assert torch.equal(out, expected)


def test_get_high_entropy_mask_with_nothing_counted_is_all_false():
    entropies = torch.rand(2, 3)
    out = GRPOTrainer.get_high_entropy_mask(_mock_trainer(), entropies, torch.zeros(2, 3), 0.2)
    assert out.dtype == torch.bool and not out.any()

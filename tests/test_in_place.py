"""grpokit/train/in_place.py: gradients are summed into `.grad` in place only where that is exact and measured,
and the head's backward hands its gradients over without a host sync."""

import types

import pytest
import torch

from grpokit.algorithms import head_token_loss
from grpokit.train import memory
from grpokit.train.in_place import in_place_gradients


def accelerator(scaler=None, accumulation=1):
    return types.SimpleNamespace(scaler=scaler, gradient_accumulation_steps=accumulation)


@pytest.mark.parametrize("device, sharded, scaler, accumulation, words", [
    ("cuda", False, None, 1, "off on cuda"),
    ("cpu", True, None, 1, "fsdp"),
    ("cpu", False, object(), 1, "scaler"),
    ("cpu", False, None, 4, "gradient_accumulation_steps"),
])
def test_each_condition_turns_it_off_and_says_why(device, sharded, scaler, accumulation, words):
    decision = in_place_gradients(torch.nn.Linear(2, 2), accelerator(scaler, accumulation), sharded,
                                  torch.device(device))
    assert not decision.enabled and words in decision.reason.lower()


def test_on_for_one_plain_process_on_a_cpu():
    decision = in_place_gradients(torch.nn.Linear(2, 2), accelerator(), False, torch.device("cpu"))
    assert decision.enabled and "cpu" in decision.reason.lower()


def test_off_under_ddp(monkeypatch):
    class FakeDDP(torch.nn.parallel.DistributedDataParallel):
        def __init__(self):  # no process group: only the type matters
            torch.nn.Module.__init__(self)

    decision = in_place_gradients(FakeDDP(), accelerator(), False, torch.device("cpu"))
    assert not decision.enabled and "ddp" in decision.reason.lower()


def test_a_trainer_on_a_cpu_decides_once_and_keeps_the_reason(tiny_model_dir, prompt_dataset, tmp_path):
    from grpokit import GRPOConfig, GRPOTrainer
    from tests.helpers import frac_a

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to=[], save_strategy="no", logging_steps=1)
    trainer = GRPOTrainer(model=str(tiny_model_dir), reward_funcs=frac_a, args=args, train_dataset=prompt_dataset)
    assert trainer.learner.in_place.enabled and trainer.learner.in_place.reason


def _head_loss(weight, into_grad):
    g = torch.Generator().manual_seed(3)
    hidden, targets = torch.randn(7, 8, generator=g).to(weight.dtype), torch.randint(0, weight.shape[0], (7,), generator=g)
    return head_token_loss(hidden, weight, None, targets, lambda x, e, part: -(x * 0.3).sum(), into_grad=into_grad)[0]


def test_a_scaled_backward_scales_the_gradients_computed_in_the_forward():
    """Upstream gradient 0.5 (a gradient scaler, accelerate's division): dL/dW halves, as autograd's would."""
    weight = torch.randn(50, 8, dtype=torch.float64).requires_grad_()
    _head_loss(weight, False).backward()
    whole = weight.grad.clone()
    weight.grad = None
    (0.5 * _head_loss(weight, False)).backward()
    torch.testing.assert_close(weight.grad, 0.5 * whole, rtol=0, atol=1e-15)


def test_a_second_backward_of_the_same_forward_is_refused():
    weight = torch.randn(50, 8).requires_grad_()
    loss = _head_loss(weight, False)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_the_trimming_hook_is_replaced_not_piled_up(monkeypatch):
    """One model object given to two trainers: one hook on its embedding, not two; none for a model on a GPU."""
    from grpokit.tiny import tiny_qwen2

    monkeypatch.setattr(memory, "TRIM_AT", 4)  # small enough for the tiny embedding
    monkeypatch.setattr(memory, "_malloc_trim", lambda: (lambda n: 0, None))
    model = tiny_qwen2(vocab_size=300, hidden_size=16, num_layers=1)
    embedding = model.get_input_embeddings()
    for _ in range(3):
        memory.trim_before_embedding_backward(model, torch.device("cpu"))
    assert len(embedding._forward_hooks) == 1
    other = tiny_qwen2(vocab_size=300, hidden_size=16, num_layers=1)
    memory.trim_before_embedding_backward(other, torch.device("cuda"))
    assert not other.get_input_embeddings()._forward_hooks


def test_the_head_losss_log_probs_and_entropies_are_constants():
    """head_token_loss hands back detached log-probs and entropies (the loss carries the gradients): both are
    marked non-differentiable, not only the last one marked."""
    weight = torch.randn(50, 8).requires_grad_()
    hidden = torch.randn(5, 8).requires_grad_()
    loss, logp, entropy = head_token_loss(hidden, weight, None, torch.randint(0, 50, (5,)),
                                          lambda x, e, part: -x.sum(), with_entropy=True, entropy_grad=False)
    assert loss.requires_grad and not logp.requires_grad and not entropy.requires_grad

"""Per-token log-probs, entropy and KL estimators: hand-worked values and a full log_softmax as the oracle."""

import math

import pytest
import torch

from grpokit.algorithms import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_k3_plus, masked_mean, token_entropy, token_logprobs


def test_logprob_hand_worked():
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]]])  # probs 1/4, 1/4, 1/2
    lp = token_logprobs(logits, torch.tensor([[2]]))
    assert lp.item() == pytest.approx(math.log(0.5), abs=1e-6)


def test_logprob_uses_temperature():
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)]]])
    lp = token_logprobs(logits, torch.tensor([[2]]), temperature=2.0)
    # softmax([0, 0, ln2 / 2]) at index 2 = sqrt2 / (2 + sqrt2)
    assert lp.item() == pytest.approx(math.log(math.sqrt(2) / (2 + math.sqrt(2))), abs=1e-6)


@pytest.mark.parametrize("chunk_elements", [1, 7, 50, 1 << 24])
def test_chunked_logprobs_and_grad_match_log_softmax(chunk_elements):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    ours = token_logprobs(logits, ids, temperature=0.7, chunk_elements=chunk_elements)
    (grad_ours,) = torch.autograd.grad(ours.sum(), logits)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    (grad_ref,) = torch.autograd.grad(ref.sum(), logits)
    assert torch.allclose(ours, ref, atol=1e-6)
    assert torch.allclose(grad_ours, grad_ref, atol=1e-6)


def test_bf16_logits_are_normalised_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 4, 32, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 32, (2, 4), generator=g)
    ours = token_logprobs(logits, ids)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    assert ours.dtype == torch.float32
    assert torch.allclose(ours, ref, atol=1e-6)


def test_entropy_hand_worked_and_against_oracle():
    uniform = torch.zeros(1, 1, 8)
    assert token_entropy(uniform).item() == pytest.approx(math.log(8), abs=1e-6)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 13, generator=g)
    p = torch.softmax(logits / 1.3, -1)
    ref = -(p * p.log()).sum(-1)
    assert torch.allclose(token_entropy(logits, temperature=1.3, chunk_elements=20), ref, atol=1e-6)


def test_kl_estimators_hand_worked():
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # log(ref / p)
    assert kl_k1(logp, ref).item() == pytest.approx(-log_r, abs=1e-6)
    assert kl_k2(logp, ref).item() == pytest.approx(0.5 * log_r**2, abs=1e-6)
    assert kl_k3(logp, ref).item() == pytest.approx(0.5 - log_r - 1, abs=1e-6)
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "k3+"}
    assert kl_k3_plus(logp, ref).item() == pytest.approx(0.5 - log_r - 1, abs=1e-6)  # k3 in value


def test_k3_zero_at_equality_non_negative_and_unbiased():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1000, generator=g)
    assert torch.equal(kl_k3(x, x), torch.zeros_like(x))
    assert (kl_k3(x, x + torch.randn(1000, generator=g)) >= 0).all()
    # E_{y~p}[k3] = KL(p || q) exactly, for small discrete distributions
    p = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    q = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    exact = (p * (p / q).log()).sum()
    expectation = (p * kl_k3(p.log(), q.log())).sum()
    assert expectation.item() == pytest.approx(exact.item(), abs=1e-12)
    assert (p * kl_k1(p.log(), q.log())).sum().item() == pytest.approx(exact.item(), abs=1e-12)


def test_masked_mean_and_empty_mask():
    v = torch.tensor([[1.0, 2.0, 100.0]])
    assert masked_mean(v, torch.tensor([[1, 1, 0]])).item() == pytest.approx(1.5)
    assert masked_mean(v, torch.zeros(1, 3)).item() == 0.0

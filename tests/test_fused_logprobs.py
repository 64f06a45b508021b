"""Log-probs from hidden states with the LM head fused in (grpokit.algorithms.head_logprobs, grpokit.passes):
equal to the unfused computation in values and gradients, and no vocabulary-sized tensor over all positions."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpokit.algorithms import head_logprobs, token_entropy, token_logprobs
from grpokit.passes import Tokens, completion_logprobs, output_head
from grpokit.passes.forward import completion_logits
from grpokit.tiny import tiny_qwen2


def _assert_grad_close(ours, theirs, name=""):
    """Equal up to fp32 rounding: 1e-6 of the tensor's largest entry (gradients here reach ~80)."""
    scale = theirs.abs().max().item()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=lambda m: f"{name}: {m}")


def _unfused(hidden, weight, bias, targets, temperature):
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return token_logprobs(logits, targets, temperature), token_entropy(logits.detach(), temperature)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk_elements", [1, 7 * 53, 1 << 24])  # one row, several rows, everything at once
def test_values_and_gradients_equal_the_unfused_head_fp32(bias, temperature, chunk_elements):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 11, 24, generator=g, requires_grad=True)
    weight = (torch.randn(53, 24, generator=g) * 0.5).requires_grad_()
    b = torch.randn(53, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, 53, (3, 11), generator=g)
    upstream = torch.randn(3, 11, generator=g)
    fused, entropy = head_logprobs(hidden, weight, b, targets, temperature, True, chunk_elements)
    grads = torch.autograd.grad((fused * upstream).sum(), [hidden, weight] + ([b] if bias else []))
    plain, plain_entropy = _unfused(hidden, weight, b, targets, temperature)
    plain_grads = torch.autograd.grad((plain * upstream).sum(), [hidden, weight] + ([b] if bias else []))
    assert fused.dtype == torch.float32 and fused.shape == (3, 11)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)  # fp32 rounding of a different sum order
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-5, atol=1e-5)
    for ours, theirs in zip(grads, plain_grads):
        _assert_grad_close(ours, theirs)


def test_float64_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 6, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda h, w, b: head_logprobs(h, w, b, targets, 0.8, chunk_elements=18)[0], (hidden, weight, bias)
    )


def test_hand_worked_value():
    # one position, H = 1, weight [[0], [1], [2]] and h = ln 2: logits 0, ln 2, 2 ln 2 -> p = (1, 2, 4) / 7
    hidden = torch.tensor([[torch.log(torch.tensor(2.0))]])
    weight = torch.tensor([[0.0], [1.0], [2.0]])
    logp, entropy = head_logprobs(hidden, weight, None, torch.tensor([2]), with_entropy=True)
    assert logp.item() == pytest.approx(torch.log(torch.tensor(4 / 7)).item(), abs=1e-6)
    p = torch.tensor([1, 2, 4]) / 7
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), abs=1e-6)


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _batch(vocab, rows=6, prompt=5, width=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, vocab, (rows // 2, prompt), generator=g).repeat_interleave(2, 0)  # pairs share
    prompts[-2:, :2] = 0  # the last prompt is left-padded
    prompt_mask = (prompts != 0).long()
    completions = torch.randint(2, vocab, (rows, width), generator=g)
    completion_mask = torch.ones_like(completions)
    completion_mask[1, 30:] = 0  # ended early: right padding
    completions[1, 30:] = 0
    return prompts, prompt_mask, completions, completion_mask


def test_training_pass_never_holds_logits_for_all_positions():
    vocab = 3000
    model = tiny_qwen2(vocab, hidden_size=32, num_layers=2, seed=0).train()
    batch = _batch(vocab)
    chunk = 8 * vocab  # 8 positions per chunk; the batch has 6 x 40 = 240
    with _LargestTensor() as probe:
        logp, entropy = completion_logprobs(model, *batch, temperature=0.9, with_entropy=True, chunk_elements=chunk)
        logp.sum().backward()
    assert probe.largest <= max(chunk, vocab * 32)  # one chunk of logits, or the (V, H) head gradient
    assert probe.largest < 6 * 40 * vocab / 4


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("share", [True, False])
def test_model_pass_equals_full_logits_path_with_padding(tied, share):
    vocab = 61
    model = tiny_qwen2(vocab, hidden_size=32, num_layers=2, seed=3).train()
    if not tied:  # an untied head with its own weights
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab, 32) * 0.1)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    prompts, prompt_mask, completions, completion_mask = _batch(vocab, seed=1)
    upstream = torch.randn(completions.shape, generator=torch.Generator().manual_seed(5)) * completion_mask
    results = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            logp, entropy = completion_logprobs(model, prompts, prompt_mask, completions, completion_mask, 0.7,
                                                with_entropy=True, share_prompts=share, chunk_elements=50 * vocab)
        else:
            logits = completion_logits(model, Tokens(prompts, prompt_mask, completions, completion_mask), share)
            logp, entropy = token_logprobs(logits, completions, 0.7), token_entropy(logits.detach(), 0.7)
        (logp * upstream).sum().backward()
        results.append((logp.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ea, ga), (b, eb, gb) = results
    valid = completion_mask.bool()
    torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ea[valid], eb[valid], rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and (("lm_head.weight" in ga) != tied)
    for name in ga:
        _assert_grad_close(ga[name], gb[name], name)


@pytest.mark.parametrize("target_modules", [["q_proj", "v_proj"], ["q_proj", "lm_head"]])
def test_lora_model_gradients_equal_the_full_logits_path(target_modules):
    from peft import LoraConfig, get_peft_model

    vocab = 61
    base = tiny_qwen2(vocab, hidden_size=32, num_layers=2, seed=4)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=target_modules, init_lora_weights=False))
    assert (type(output_head(model)) is torch.nn.Linear) == ("lm_head" not in target_modules)  # module path else
    prompts, prompt_mask, completions, completion_mask = _batch(vocab, seed=2)
    results = []
    for fused in (True, False):
        model.zero_grad()
        if fused:
            logp, entropy = completion_logprobs(model, prompts, prompt_mask, completions, completion_mask, 1.3,
                                                with_entropy=True, chunk_elements=20 * vocab)
        else:
            logits = completion_logits(model, Tokens(prompts, prompt_mask, completions, completion_mask))
            logp, entropy = token_logprobs(logits, completions, 1.3), token_entropy(logits.detach(), 1.3)
        (logp * completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((logp.detach(), entropy, grads))
    (a, ea, ga), (b, eb, gb) = results
    valid = completion_mask.bool()
    torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ea[valid], eb[valid], rtol=1e-5, atol=1e-5)
    assert ga.keys() == gb.keys() and all("lora" in n for n in ga)
    for name in ga:
        _assert_grad_close(ga[name], gb[name], name)


def test_models_that_change_logits_after_the_head_take_the_full_logits_path():
    model = tiny_qwen2(40, hidden_size=32, num_layers=1, seed=0)
    assert output_head(model) is model.lm_head
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 has
    assert output_head(model) is None
    model.config.final_logit_softcapping = None
    model.config.lm_head_multiplier = 1.0  # Falcon-H1's default: the logits are the head's
    assert output_head(model) is model.lm_head
    model.config.lm_head_multiplier = 0.5
    assert output_head(model) is None


def test_bf16_autocast_is_close_to_fp32_and_gradients_flow():
    vocab = 301
    model = tiny_qwen2(vocab, hidden_size=64, num_layers=2, seed=6).train()
    batch = _batch(vocab, seed=3)
    valid = batch[3].bool()
    reference, _ = completion_logprobs(model, *batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, _ = completion_logprobs(model, *batch, chunk_elements=16 * vocab)
    assert logp.dtype == torch.float32  # the normaliser accumulates in fp32
    logp[valid].sum().backward()
    assert (logp - reference)[valid].abs().max() < 0.1  # bf16 rounding of a 64-wide model, not a wrong formula
    grad = model.model.embed_tokens.weight.grad
    assert grad.dtype == torch.float32 and torch.isfinite(grad).all() and grad.abs().sum() > 0


def _reference_entropy(hidden, weight, bias, temperature):
    """H = -sum_v p log p from plain fp64 autograd ops."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp = torch.log_softmax(logits, -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_elements", [7 * 11, 1 << 20])
def test_entropy_gradient_of_the_fused_head_equals_autograd(chunk_elements):
    """An entropy bonus differentiates H: the fused backward adds -g_H p (log p + H); checked against fp64
    autograd together with a log-prob gradient, for hidden states, weight and bias."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    g_logp, g_entropy = torch.randn(3, 5, generator=g, dtype=torch.float64), torch.randn(3, 5, generator=g, dtype=torch.float64)
    logp, entropy = head_logprobs(hidden, weight, bias, targets, 0.7, True, chunk_elements, entropy_grad=True)
    fused = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), (hidden, weight, bias))
    ref_logp = torch.log_softmax(torch.nn.functional.linear(hidden, weight, bias) / 0.7, -1)
    ref_logp = ref_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = _reference_entropy(hidden, weight, bias, 0.7)
    expected = torch.autograd.grad((ref_logp * g_logp).sum() + (ref_entropy * g_entropy).sum(), (hidden, weight, bias))
    for ours, theirs in zip(fused, expected):
        assert torch.allclose(ours, theirs, atol=1e-10)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-12, rtol=0)


def test_entropy_is_a_constant_unless_asked():
    hidden = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64)
    _, entropy = head_logprobs(hidden, weight, None, torch.zeros(2, 3, dtype=torch.long), 1.0, True)
    assert not entropy.requires_grad
    logits = torch.randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    assert not token_entropy(logits).requires_grad
    assert token_entropy(logits, differentiable=True).requires_grad


def test_entropy_gradient_through_a_wrapped_head_equals_the_full_logits_path():
    """A head that is not a plain Linear (LoRA, quantised) takes module_logprobs: its entropy gradient matches."""
    model = tiny_qwen2(20, hidden_size=16, num_heads=2, seed=3).double()
    head = model.lm_head
    class Wrapped(torch.nn.Module):  # not a torch.nn.Linear: the module path, as for a LoRA-wrapped head
        def __init__(self, inner):
            super().__init__()
            self.inner, self.out_features = inner, inner.out_features

        def forward(self, x):
            return self.inner(x)

    model.lm_head = Wrapped(head)
    assert isinstance(output_head(model), Wrapped)
    prompt = torch.randint(1, 20, (2, 3))
    completion = torch.randint(1, 20, (2, 4))
    ones_p, ones_c = torch.ones_like(prompt), torch.ones_like(completion)
    _, entropy = completion_logprobs(model, prompt, ones_p, completion, ones_c, 0.9, with_entropy=True,
                                     chunk_elements=20 * 3, entropy_grad=True)
    ours = torch.autograd.grad(entropy.sum(), head.weight)[0]
    logits = completion_logits(model, Tokens(prompt, ones_p, completion, ones_c))
    expected = torch.autograd.grad(token_entropy(logits, 0.9, differentiable=True).sum(), head.weight)[0]
    assert torch.allclose(ours, expected, atol=1e-6)


@pytest.mark.parametrize("chunk_elements", [7 * 301, 1 << 20])
def test_under_cpu_autocast_dW_is_the_fp32_product_of_the_bf16_logits_gradient(chunk_elements, monkeypatch):
    """Under CPU bf16 autocast the logits come from bf16 operands (widened to fp32 for the softmax, the bias added
    there), dL/dh from dL/dz narrowed to bf16, and dL/dW from the fp32 dL/dz and the fp32 hidden states, summed in
    fp32: equal to that formula in fp64 to 1e-5 (a bf16 dL/dW product would be off by ~1e-2), for head_logprobs'
    backward and for head_token_loss, which computes it in its forward: with entropy_grad (the chunk's logits
    kept, dL/dz narrowed into a scratch buffer) and without (the softmax written over the bf16 product in one
    buffer's bytes, dL/dz narrowed in place), the entropies too. Blocks of 2 rows, as a real vocabulary's 13
    inside its 110-row chunks: the softmax of each block is written over product rows already read."""
    from grpokit.algorithms import head_buffers, head_token_loss

    monkeypatch.setattr(head_buffers, "STATS_ELEMENTS", 2 * 301)

    g = torch.Generator().manual_seed(11)
    vocab, width, n = 301, 24, 40
    hidden = torch.randn(n, width, generator=g)
    weight = torch.randn(vocab, width, generator=g) * 0.3
    bias = torch.randn(vocab, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    # the bf16 product, widened, the bf16 bias added, tempered
    z = ((hidden.bfloat16() @ weight.bfloat16().t()).double() + bias.bfloat16().double()) / 0.8
    p = torch.softmax(z, -1)
    dz = (torch.nn.functional.one_hot(targets, vocab).double() - p) * upstream.double().unsqueeze(-1) / 0.8
    expected_w, expected_b = dz.t() @ hidden.double(), dz.sum(0)
    expected_h = (dz.float().bfloat16().double() @ weight.bfloat16().double())
    expected_logp = torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(p * torch.log_softmax(z, -1)).sum(-1)

    h, w, b = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, entropy = head_logprobs(h, w, b, targets, 0.8, True, chunk_elements=chunk_elements)
    (logp * upstream).sum().backward()
    torch.testing.assert_close(logp.double(), expected_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), expected_w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.grad.double(), expected_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h.grad.double(), expected_h, rtol=1e-2, atol=1e-3)

    for entropy_grad in (True, False):
        h2, w2, b2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, logp2, entropy2 = head_token_loss(h2, w2, b2, targets, lambda x, e, part: (x * upstream[part]).sum(),
                                                    0.8, True, chunk_elements=chunk_elements,
                                                    entropy_grad=entropy_grad)
        loss.backward()
        assert torch.equal(logp2, logp) and torch.equal(entropy2, entropy)  # the same arithmetic
        torch.testing.assert_close(w2.grad.double(), expected_w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b2.grad.double(), expected_b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h2.grad, h.grad, rtol=1e-4, atol=1e-5)


def test_logits_spread_past_the_exp_floor_give_the_exact_values_and_gradients():
    """Logits spread over hundreds of nats (a temperature of 0.5 on wide logits): exp's arguments below
    fused_head.EXP_FLOOR (-87) are clamped, which changes nothing at fp32 resolution: log-probs, entropies and
    gradients equal fp64 autograd on the unclamped formula."""
    from grpokit.algorithms.fused_head import EXP_FLOOR

    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(12, 16, generator=g) * 4
    weight = torch.randn(500, 16, generator=g) * 4
    targets = torch.randint(0, 500, (12,), generator=g)
    upstream, g_entropy = torch.randn(12, generator=g), torch.randn(12, generator=g)
    z = hidden.double() @ weight.double().t() / 0.5
    assert float((z - z.amax(-1, keepdim=True)).min()) < 3 * EXP_FLOOR  # far into the clamped range

    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = head_logprobs(h, w, None, targets, 0.5, True, 7 * 500, entropy_grad=True)
    ((logp * upstream).sum() + (entropy * g_entropy).sum()).backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = torch.log_softmax(h64 @ w64.t() / 0.5, -1)
    ref_logp = ref.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(ref.exp() * ref).sum(-1)
    ((ref_logp * upstream.double()).sum() + (ref_entropy * g_entropy.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy.double(), ref_entropy.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("chunk_elements", [7 * 301, 1 << 20])
def test_a_bf16_head_without_autocast_gives_fp32_log_probs_and_bf16_gradients(chunk_elements, monkeypatch):
    """A model loaded in bf16 (no autocast): bf16 products, fp32 softmax; dL/dh is the bf16 product of dL/dz narrowed
    to bf16, dL/dW the fp32 product summed in fp32, both returned in the weights' dtype. Blocks of 3 rows."""
    from grpokit.algorithms import head_buffers, head_token_loss

    monkeypatch.setattr(head_buffers, "STATS_ELEMENTS", 3 * 301)

    g = torch.Generator().manual_seed(12)
    vocab, width, n = 301, 24, 40
    hidden = torch.randn(n, width, generator=g).bfloat16()
    weight = (torch.randn(vocab, width, generator=g) * 0.3).bfloat16()
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    z = (hidden @ weight.t()).double()
    p = torch.softmax(z, -1)
    dz = (torch.nn.functional.one_hot(targets, vocab).double() - p) * upstream.double().unsqueeze(-1)
    expected_w = dz.t() @ hidden.double()
    expected_h = dz.float().bfloat16().double() @ weight.double()
    for loss_inside in (False, "keep", "probs"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if loss_inside:
            loss, logp, _ = head_token_loss(h, w, None, targets, lambda x, e, part: (x * upstream[part]).sum(),
                                            chunk_elements=chunk_elements, entropy_grad=loss_inside == "keep")
            loss.backward()
        else:
            logp, _ = head_logprobs(h, w, None, targets, chunk_elements=chunk_elements)
            (logp * upstream).sum().backward()
        assert logp.dtype == torch.float32 and w.grad.dtype == h.grad.dtype == torch.bfloat16
        torch.testing.assert_close(logp.double(), torch.log_softmax(z, -1).gather(-1, targets.unsqueeze(-1))
                                   .squeeze(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(w.grad.double(), expected_w, rtol=1e-2, atol=1e-2)  # rounded to bf16 at the end
        torch.testing.assert_close(h.grad.double(), expected_h, rtol=1e-2, atol=1e-2)

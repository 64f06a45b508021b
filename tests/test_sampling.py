"""The counter-based inverse-CDF sampler and the rollout built on it: exact draws, no filtered token ever drawn,
tokens independent of the batch, the decode loop equal to transformers.generate with the same sampler."""

import pytest
import torch

import grpokit.rollout.sampling as sampling
from grpokit.rollout.generate import SamplingParams, generate_completions
from grpokit.rollout.sampling import CounterSampler, hashed_uniform, inverse_cdf_sample
from grpokit.tiny import char_tokenizer, tiny_qwen2

NEG = -float("inf")


def test_hand_worked_draws_across_block_boundaries(monkeypatch):
    monkeypatch.setattr(sampling, "BLOCK", 2)  # blocks {0,1} {2,3} {4}: the search crosses blocks and a short tail
    p = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4])
    scores = p.log().expand(9, 5)
    u = torch.tensor([0.05, 0.11, 0.15, 0.29, 0.31, 0.59, 0.61, 0.999, 1 - 1e-16], dtype=torch.float64)
    # cumulative 0.1, 0.3, 0.3, 0.6, 1.0: token v is drawn for F(v-1) <= u < F(v); index 2 (p = 0) never
    assert inverse_cdf_sample(scores, u).tolist() == [0, 1, 1, 1, 3, 3, 4, 4, 4]


def test_filtered_tokens_are_never_drawn_even_at_the_ends():
    scores = torch.full((4, 1000), NEG)
    scores[:, 0] = 0.0
    scores[:, 700] = 1.0  # only tokens 0 and 700 are allowed; the tail after 700 is all -inf
    u = torch.tensor([1e-16, 0.5, 1 - 1e-16, 0.999999], dtype=torch.float64)
    assert set(inverse_cdf_sample(scores, u).tolist()) <= {0, 700}
    assert inverse_cdf_sample(scores, u)[[0, 2]].tolist() == [0, 700]


def test_frequencies_match_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1300, generator=g) * 2  # spans three blocks
    n = 200_000
    tokens = inverse_cdf_sample(logits.expand(n, -1), hashed_uniform(7, torch.arange(n), 0))
    freq = torch.bincount(tokens, minlength=1300).double() / n
    p = torch.softmax(logits[0].double(), -1)
    assert (freq - p).abs().max() < 4 * (p.max() / n) ** 0.5  # 4 standard errors of the largest cell
    assert (freq - p).abs().sum() < 0.05  # total variation of 200k draws over 1300 cells


def test_logits_spread_past_the_exp_floor_draw_what_the_exact_distribution_draws():
    """Rows whose logits spread hundreds of nats below their top (and -inf filtered entries): the sampler drops
    probabilities below exp(EXP_FLOOR) of the top token's instead of computing them as denormals; every draw and
    log-prob equals the inverse-CDF draw under the exact fp64 distribution."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(64, 3000, generator=g) * 60  # ~400 nats from top to bottom
    scores[::3, 1000:1400] = NEG  # filtered entries in some rows
    assert float((scores.amin(-1) - scores.amax(-1)).max()) < 3 * sampling.EXP_FLOOR
    u = hashed_uniform(11, torch.arange(64), 3)
    tokens, logp = inverse_cdf_sample(scores, u, with_logprob=True)
    exact = torch.softmax(scores.double(), -1)
    cdf = exact.cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    assert tokens.tolist() == expected.tolist()
    torch.testing.assert_close(logp.double(), exact.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log(),
                               rtol=1e-6, atol=1e-5)
    assert not bool(torch.isinf(scores.gather(-1, tokens.unsqueeze(-1))).any())


def test_uniforms_are_a_pure_function_of_seed_sample_and_position():
    u = hashed_uniform(3, torch.tensor([5, 9, 5]), 4)
    assert u[0] == u[2] and u[0] != u[1]
    assert hashed_uniform(3, torch.tensor([9]), 4)[0] == u[1]  # the same alone as in a batch
    assert hashed_uniform(4, torch.tensor([5]), 4)[0] != u[0] and hashed_uniform(3, torch.tensor([5]), 5)[0] != u[0]
    many = hashed_uniform(0, torch.arange(100_000), 0)
    assert 0 < many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.005
    assert many.unique().numel() == 100_000


def test_as_a_logits_processor_only_the_drawn_token_stays_finite():
    sampler = CounterSampler(1, torch.tensor([0, 1]), prompt_length=3)
    scores = torch.randn(2, 50)
    out = sampler(torch.zeros(2, 5, dtype=torch.long), scores)  # completion position 2
    assert torch.equal(out.argmax(-1), sampler.sample(scores, 2))
    assert (torch.isfinite(out).sum(-1) == 1).all()


@pytest.fixture(scope="module")
def model_and_tokenizer():
    tokenizer = char_tokenizer()
    return tiny_qwen2(len(tokenizer), hidden_size=48, num_layers=2, seed=1).eval(), tokenizer


SETTINGS = {
    "plain": SamplingParams(max_completion_length=10, temperature=1.0),
    "filters": SamplingParams(max_completion_length=10, temperature=0.8, top_k=12, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.2),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_a_completion_does_not_depend_on_the_rest_of_the_batch(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in ("12+3=", "4+5=", "100+20=")]
    rows = [p for p in prompts for _ in range(3)]
    params = SETTINGS[name]
    batch = generate_completions(model, tokenizer, rows, torch.arange(9) + 100, params, seed=5)
    for row in (0, 4, 8):
        alone = generate_completions(model, tokenizer, [rows[row]], torch.tensor([100 + row]), params, seed=5)
        width = alone.completion_ids.shape[1]
        assert torch.equal(batch.completion_ids[row, :width], alone.completion_ids[0])
    other_seed = generate_completions(model, tokenizer, rows, torch.arange(9) + 100, params, seed=6)
    assert not torch.equal(other_seed.completion_ids, batch.completion_ids)


@pytest.mark.parametrize("name", SETTINGS)
def test_decode_loop_equals_transformers_generate_with_the_same_sampler(model_and_tokenizer, name):
    model, tokenizer = model_and_tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in ("7+8=", "31+4=")]
    rows = [p for p in prompts for _ in range(4)]
    params = SETTINGS[name]
    loop = generate_completions(model, tokenizer, rows, torch.arange(8), params, seed=2)
    # an option the loop does not implement sends the rollout through model.generate, with the same sampler last
    fallback = SamplingParams(**{**params.__dict__, "generation_kwargs": {"no_repeat_ngram_size": 0}})
    generated = generate_completions(model, tokenizer, rows, torch.arange(8), fallback, seed=2)
    assert torch.equal(loop.completion_ids, generated.completion_ids)
    assert torch.equal(loop.completion_mask, generated.completion_mask)


def test_top_k_one_is_greedy(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [tokenizer("5+5=")["input_ids"]] * 3
    out = generate_completions(model, tokenizer, rows, torch.arange(3), SamplingParams(8, top_k=1), seed=0)
    ids = torch.tensor([rows[0]])
    expected = []
    for _ in range(out.completion_mask[0].sum()):
        token = model(ids).logits[0, -1].argmax()
        expected.append(int(token))
        ids = torch.cat([ids, token.view(1, 1)], 1)
    assert out.completion_ids[0, : len(expected)].tolist() == expected
    assert torch.equal(out.completion_ids[0], out.completion_ids[1])


def test_ids_above_2_to_the_32_get_their_own_noise():
    """Eval samples (id + 2^40) and later turns of an episode (id + k * 2^44) must not replay a training sample's
    uniforms; ids below 2^32 keep the numbers they always had."""
    from grpokit.rollout.multiturn import TURN_STRIDE
    from grpokit.rollout.sampling import hashed_uniform

    ids = torch.arange(64)
    base = torch.stack([hashed_uniform(7, ids, t) for t in range(16)])  # (T, 64)
    for offset in (TURN_STRIDE, 2 * TURN_STRIDE, 2**40, 2**32):
        other = torch.stack([hashed_uniform(7, ids + offset, t) for t in range(16)])
        assert (other != base).float().mean() > 0.99, offset
        assert abs(other.mean().item() - 0.5) < 0.05  # still uniform-looking

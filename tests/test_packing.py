"""Padding-free packing (grpokit/passes/packing.py) and token budgets: the packed passes give the padded passes' values
and gradients (fp32), in every family that packs and every mode; rows and forwards respect their capacities; and
a training step's loss and gradients do not depend on how token_budget groups the samples, for every loss_type."""

import contextlib
import math

import datasets
import pytest
import torch
import transformers

from grpokit import GRPOConfig, GRPOTrainer
from grpokit.passes import packing
from grpokit.config import ConfigError
from grpokit.passes import completion_logprobs, packs

VOCAB = 97


@pytest.fixture(autouse=True)
def always_packed_and_fused(monkeypatch):
    """These tiny models are below the sizes where grpokit chooses packing (PACK_WHEN) and the loss inside the
    head (FUSED_LOSS_MIN_HEAD) by itself: force both, so that they are what the tests compare."""
    from grpokit.passes import dispatch
    from grpokit.train import learner_step

    monkeypatch.setattr(dispatch, "PACK_WHEN", float("inf"))
    monkeypatch.setattr(learner_step, "FUSED_LOSS_MIN_HEAD", 0)


def family_model(name: str, attention: str = "sdpa"):
    """A tiny random-init model of a real family (2 layers, hidden 64), fp32."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "qwen2": lambda: transformers.Qwen2Config(**common, tie_word_embeddings=True),
        "llama": lambda: transformers.LlamaConfig(**common, tie_word_embeddings=False),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "phi3": lambda: transformers.Phi3Config(**common, pad_token_id=0),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
    }
    config = configs[name]()
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).float()


def ragged_batch(seed: int = 0, prompts=((3, 3), (7, 2), (5, 3)), completions=(9, 1, 4, 9, 0, 6, 2, 8)):
    """Left-padded prompts (distinct prompts of the given lengths, each repeated) and right-padded completions of
    the given lengths (0: empty)."""
    g = torch.Generator().manual_seed(seed)
    distinct = [(length, torch.randint(1, VOCAB, (length,), generator=g), repeat) for length, repeat in prompts]
    rows = [(length, ids) for length, ids, repeat in distinct for _ in range(repeat)]
    width = max(length for length, _ in rows)
    prompt_ids = torch.zeros(len(rows), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, (length, ids) in enumerate(rows):
        prompt_ids[i, width - length :] = ids
        prompt_mask[i, width - length :] = 1
    lengths = completions[: len(rows)]
    completion_ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for i, length in enumerate(lengths):
        completion_ids[i, :length] = torch.randint(1, VOCAB, (length,), generator=g)
        completion_mask[i, :length] = 1
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def values_and_grads(model, batch, pack: bool, entropy_grad=True, **kwargs):
    model.zero_grad()
    g = torch.Generator().manual_seed(1)
    mask = batch[3].float()
    upstream = torch.randn(mask.shape, generator=g) * mask
    logp, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True, pack=pack,
                                        share_prompts=False, entropy_grad=entropy_grad, **kwargs)
    ((logp * upstream).sum() + 0.3 * (entropy * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return (logp * mask).detach(), (entropy * mask).detach(), grads


def assert_same(packed, padded, tol=1e-5):
    torch.testing.assert_close(packed[0], padded[0], rtol=tol, atol=tol)
    torch.testing.assert_close(packed[1], padded[1], rtol=tol, atol=tol)
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name in padded[2]:
        scale = padded[2][name].abs().max().clamp(min=1e-6)
        assert (packed[2][name] - padded[2][name]).abs().max() <= tol * scale, name


@pytest.mark.parametrize("family", ["qwen2", "llama", "qwen3", "phi3", "mistral"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_equals_padded_values_and_gradients(family, attention):
    model = family_model(family, attention)
    assert packs(model)
    batch = ragged_batch()
    assert_same(values_and_grads(model, batch, True), values_and_grads(model, batch, False))


def test_packed_rows_of_a_small_capacity_equal_padded(monkeypatch):
    """Many rows, a prompt repeated in several rows, tail padding in every row but the longest."""
    monkeypatch.setattr(packing, "ROW_TOKENS", 1)
    model = family_model("qwen2")
    batch = ragged_batch(seed=3)
    assert_same(values_and_grads(model, batch, True), values_and_grads(model, batch, False))


def test_packed_with_gradient_checkpointing_and_lora():
    from peft import LoraConfig, get_peft_model

    model = family_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    model = get_peft_model(model, lora)
    model.enable_input_require_grads()
    model.train()
    assert packs(model)
    batch = ragged_batch(seed=5)
    assert_same(values_and_grads(model, batch, True), values_and_grads(model, batch, False))


def test_sliding_windows_and_post_head_transforms_take_the_padded_path():
    sliding = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, sliding_window=4)
    assert not packs(transformers.AutoModelForCausalLM.from_config(sliding))
    softcap = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    assert not packs(transformers.AutoModelForCausalLM.from_config(softcap))


def test_a_layout_the_packer_cannot_read_takes_the_padded_path():
    model = family_model("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    completion_mask[0, 2] = 0  # a hole inside a completion: not right padding
    assert not packing.packable(prompt_mask, completion_mask)
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    packed, padded = values_and_grads(model, batch, True), values_and_grads(model, batch, False)
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=0)


def test_plan_places_every_sample_once_within_capacity_with_each_prompt_once_per_row():
    g = torch.Generator().manual_seed(0)
    groups = torch.randint(0, 5, (60,), generator=g).tolist()
    prompt_of = {u: int(torch.randint(1, 40, (1,), generator=g)) for u in range(5)}
    prompts = [prompt_of[u] for u in groups]
    completions = torch.randint(0, 90, (60,), generator=g).tolist()
    layout = packing.plan(groups, prompts, completions, 150)
    placed = [i for row in layout.rows for _, members in row for i in members]
    assert sorted(placed) == list(range(60))
    for row, fill in zip(layout.rows, layout.fills):
        assert len({u for u, _ in row}) == len(row)  # a prompt once per row
        assert all(groups[i] == u for u, members in row for i in members)
        assert fill == sum(prompt_of[u] + sum(completions[i] for i in members) for u, members in row) <= 150
    assert layout.width == max(layout.fills)
    # sharing: fewer tokens than one row per sample
    assert sum(layout.fills) < sum(p + c for p, c in zip(prompts, completions))


def test_build_gives_each_token_its_padded_position_and_predecessor():
    prompt_ids, prompt_mask, completion_ids, completion_mask = ragged_batch()
    groups = [0, 0, 0, 1, 1, 2, 2, 2]
    prompts, completions = packing.lengths(prompt_mask, completion_mask)
    layout = packing.plan(groups, prompts.tolist(), completions.tolist(), 30)
    pack = packing.build(layout, prompt_ids, prompt_mask, completion_ids, completion_mask)
    flat_ids, flat_pos = pack.input_ids.reshape(-1), pack.position_ids.reshape(-1)
    assert len(pack.source) == int(completion_mask.sum())
    for k, (i, t) in enumerate(zip(pack.sample.tolist(), pack.offset.tolist())):
        src = int(pack.source[k])
        expected = prompt_ids[i, -1] if t == 0 else completion_ids[i, t - 1]
        assert flat_ids[src] == expected  # the predecessor of completion token t
        assert flat_pos[src] == int(prompts[i]) + t - 1
    mask = packing.attention_mask(pack)
    assert mask.shape == (len(layout.rows), 1, layout.width, layout.width)
    assert bool(mask[:, 0].diagonal(dim1=-2, dim2=-1).all())  # every token (padding too) sees itself


def test_budget_forwards_stay_within_the_budget_and_cover_every_sample():
    g = torch.Generator().manual_seed(1)
    groups = [i // 8 for i in range(64)]
    prompts = [int(torch.randint(32, 200, (1,), generator=g)) for _ in range(8) for _ in range(8)]
    prompts = [prompts[8 * (i // 8)] for i in range(64)]
    completions = torch.randint(1, 500, (64,), generator=g).tolist()
    for budget in (700, 1500, 4096, 10**6):
        forwards = packing.budget_forwards(groups, prompts, completions, budget)
        assert sorted(i for f in forwards for i in f.samples) == list(range(64))
        for f in forwards:
            assert len(f.layout.rows) * f.layout.width <= budget
            assert f.layout.width == max(f.layout.fills) and f.weight == 1.0
    with pytest.raises(ValueError, match="does not fit token_budget=400"):
        packing.budget_forwards(groups, prompts, completions, 400)


def test_equalize_splits_then_fills_with_zero_weight_forwards(monkeypatch):
    monkeypatch.setattr(packing, "ROW_TOKENS", 24)
    groups, prompts, completions = [0] * 6, [4] * 6, [10] * 6
    (whole,) = packing.budget_forwards(groups, prompts, completions, 10**4)  # 3 rows of 24 tokens, one forward
    assert whole.layout.fills == [24, 24, 24]
    split = packing.equalize([whole], 3)
    assert [len(f.layout.rows) for f in split] == [1, 1, 1] and all(f.weight == 1.0 for f in split)
    assert sorted(i for f in split for i in f.samples) == list(range(6))
    padded = packing.equalize([whole], 5)
    assert [f.weight for f in padded] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert sorted(i for f in padded if f.weight for i in f.samples) == list(range(6))


# ---------------------------------------------------------------------------- the trainer
def length_reward(prompts, completions, **kwargs):
    return [len(c) / 10.0 + (0.5 if "a" in c else 0.0) for c in completions]


def train_once(model_dir, tmp_path, name, **options):
    args = GRPOConfig(
        output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=12, max_prompt_length=16, learning_rate=1e-2, logging_steps=1,
        save_strategy="no", seed=3, report_to=[], disable_tqdm=True, **options,
    )
    prompts = datasets.Dataset.from_list([{"prompt": f"{i}+{i * 3}="} for i in range(16)])
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)  # weights linear in the gradients: compared tightly
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model, length_reward, args, prompts, processing_class=tokenizer, optimizers=(sgd, None))
    forward = trainer.learner.micro_batch_loss
    trainer.forwards = 0

    def counted(*a, **k):
        trainer.forwards += 1
        return forward(*a, **k)

    trainer.learner.micro_batch_loss = counted
    trainer.train()
    return trainer


def final_weights(trainer):
    return {n: p.detach().clone() for n, p in trainer.learner.unwrapped.named_parameters()}


LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "sequence_sum", "cispo", "gmpo", "luspo", "sapo", "vespo"]


@pytest.mark.parametrize("loss_type", LOSS_TYPES + ["gspo"])
def test_the_loss_does_not_depend_on_the_token_budget(tiny_model_dir, tmp_path, loss_type):
    """The same samples trained with one forward per micro-batch (token_budget=0) and with token budgets that
    regroup them (smaller: forwards of a few samples; larger, and the automatic one: both micro-batches in one
    forward): equal losses and weights."""
    options = dict(loss_type=loss_type, beta=0.05, num_iterations=2, entropy_coef=0.01)
    if loss_type == "gspo":  # GSPO: sequence-level importance sampling
        options.update(loss_type="grpo", importance_sampling_level="sequence")
    plain = train_once(tiny_model_dir, tmp_path, "plain", token_budget=0, **options)
    reference = final_weights(plain)
    assert plain.forwards == 2 * 2  # steps x micro-batches
    # None: the automatic budget (2048 here), which holds both micro-batches of a step in one forward
    for budget, forwards in ((40, lambda n: n > 4), (4096, lambda n: n == 2), (None, lambda n: n == 2)):
        budgeted = train_once(tiny_model_dir, tmp_path, f"b{budget}", token_budget=budget, **options)
        assert forwards(budgeted.forwards), budgeted.forwards
        for row, expected in zip(budgeted.state.log_history, plain.state.log_history):
            for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"):
                if key in expected:
                    assert math.isclose(row[key], expected[key], rel_tol=2e-4, abs_tol=2e-6), (budget, key)
        for name, value in final_weights(budgeted).items():
            torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)


def test_token_budget_refusals():
    with pytest.raises(ConfigError, match="at least 528"):
        GRPOConfig(output_dir="x", token_budget=100, max_completion_length=16)
    with pytest.raises(ConfigError, match="padding_free"):
        GRPOConfig(output_dir="x", token_budget=4096, padding_free=False)
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        GRPOConfig(output_dir="x", token_budget=4096, top_entropy_quantile=0.2)
    for off in (0, -1, None):  # TRL: <= 0 disables token budgeting
        assert GRPOConfig(output_dir="x", token_budget=off, top_entropy_quantile=0.2).resolved_token_budget is None


def test_the_automatic_token_budget():
    """Unset, token_budget is the longest sample the options allow, at least AUTO_TOKEN_BUDGET; off where the
    regrouping would not be exact or there is nothing to pack."""
    assert GRPOConfig(output_dir="x").resolved_token_budget == 2048  # 512 + 256 < AUTO_TOKEN_BUDGET
    assert GRPOConfig(output_dir="x", max_prompt_length=4096, max_completion_length=1024).resolved_token_budget \
        == 5120
    assert GRPOConfig(output_dir="x", padding_free=False).resolved_token_budget is None
    assert GRPOConfig(output_dir="x", top_entropy_quantile=0.5).resolved_token_budget is None


def test_the_automatic_budget_needs_a_per_sample_objective_and_grows_to_a_long_prompt(tiny_model_dir, tmp_path):
    """A user objective not registered per_sample (its loss might couple the completions of a micro-batch) gets no
    automatic budget, an explicit one still; with untruncated prompts the automatic budget grows to a longer
    sample, where an explicit budget stops the run with an error naming it."""
    from grpokit.algorithms import POLICY_OBJECTIVES
    from grpokit.algorithms.losses import clip_objective

    POLICY_OBJECTIVES.register("test_coupled_objective", clip_objective)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = datasets.Dataset.from_list([{"prompt": "1+1="}] * 4)

    def trainer(**options):
        args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=12, save_strategy="no", report_to=[], **options)
        return GRPOTrainer(tiny_model_dir, length_reward, args, prompts, processing_class=tokenizer)

    assert trainer(loss_type="test_coupled_objective").learner.token_budget is None
    assert trainer(loss_type="test_coupled_objective", token_budget=600).learner.token_budget == 600
    auto = trainer(max_prompt_length=None).learner
    assert auto.token_budget == 2048
    ids = torch.ones(3, 3000, dtype=torch.long)
    ids[1] = 2  # two distinct prompts of 3000 tokens
    forwards = auto.forwards(ids, torch.ones(3, 3000), torch.ones(3, 12), torch.arange(3))
    assert sorted(i for f in forwards for i in f.samples) == [0, 1, 2]
    explicit = trainer(max_prompt_length=None, token_budget=2048).learner
    with pytest.raises(ConfigError, match="token_budget=2048"):
        explicit.forwards(ids, torch.ones(3, 3000), torch.ones(3, 12), torch.arange(3))


# ---------------------------------------------------------------------------- the loss inside the head
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_head_token_loss_equals_head_logprobs_then_the_loss(entropy_grad):
    """Values and gradients (hidden, weight, bias) of the fused loss equal the two-step computation, with an
    entropy term and a temperature, in fp32; chunks of 7 rows so that several chunks run. Without entropy_grad
    the entropy is a constant of the loss (and the forward builds dL/dz from the softmax it left in the chunk)."""
    from grpokit.algorithms import head_logprobs, head_token_loss

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (0.3 * torch.randn(VOCAB, 16, generator=g)).requires_grad_()
    bias = (0.1 * torch.randn(VOCAB, generator=g)).requires_grad_()
    targets = torch.randint(0, VOCAB, (40,), generator=g)
    adv, old = torch.randn(40, generator=g), -torch.rand(40, generator=g) * 5

    def per_token(logp, entropy, idx):
        ratio = torch.exp(logp - old[idx])
        return (-torch.min(ratio * adv[idx], ratio.clamp(0.8, 1.2) * adv[idx])).sum() - 0.05 * entropy.sum()

    results = []
    for fused in (True, False):
        for t in (hidden, weight, bias):
            t.grad = None
        if fused:
            loss, logp, entropy = head_token_loss(hidden, weight, bias, targets,
                                                  lambda x, e, part: per_token(x, e, part), 0.7, True,
                                                  chunk_elements=7 * VOCAB, entropy_grad=entropy_grad)
        else:
            logp, entropy = head_logprobs(hidden, weight, bias, targets, 0.7, True, 7 * VOCAB,
                                          entropy_grad=entropy_grad)
            loss = per_token(logp, entropy, slice(None))
        (2.5 * loss).backward()
        results.append((loss.detach(), logp.detach(), entropy.detach(),
                        [t.grad.clone() for t in (hidden, weight, bias)]))
    (a_loss, a_logp, a_ent, a_grads), (b_loss, b_logp, b_ent, b_grads) = results
    torch.testing.assert_close(a_loss, b_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(a_logp, b_logp, rtol=0, atol=0)
    torch.testing.assert_close(a_ent, b_ent, rtol=0, atol=0)
    for x, y in zip(a_grads, b_grads):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def _tied_micro_batches(into_grad, hook=None):
    """Two micro-batches through a tied head (the weight is also the embedding, so its gradient has two
    sources), both with `into_grad`. Returns, per micro-batch, the address of the weight's gradient before and
    after the forward (None: no gradient), and the final gradients."""
    from grpokit.algorithms import head_token_loss

    g = torch.Generator().manual_seed(5)
    weight = (0.3 * torch.randn(VOCAB, 16, generator=g)).requires_grad_()
    mix = torch.randn(16, 16, generator=g).requires_grad_()
    if hook is not None:
        weight.register_hook(hook)
    seen = []
    for batch in range(2):
        ids = torch.randint(0, VOCAB, (24,), generator=g)
        targets = torch.randint(0, VOCAB, (24,), generator=g)
        adv = torch.randn(24, generator=g)
        hidden = torch.tanh(weight[ids] @ mix)
        before = None if weight.grad is None else weight.grad.data_ptr()
        loss, _, _ = head_token_loss(hidden, weight, None, targets, lambda x, e, part: -(x * adv[part]).sum(),
                                     0.9, chunk_elements=5 * VOCAB, into_grad=into_grad)
        seen.append((before, None if weight.grad is None else weight.grad.data_ptr()))
        loss.backward()
    return seen, weight.grad, mix.grad


def test_into_grad_sums_dW_into_the_weights_gradient():
    """into_grad: dL/dW is summed straight into weight.grad (created at the first micro-batch's forward), which
    keeps its buffer through the step, and the gradients equal the plain path's."""
    _, weight_grad, mix_grad = _tied_micro_batches(into_grad=False)
    seen, in_place_weight, in_place_mix = _tied_micro_batches(into_grad=True)
    (first_before, first_during), (second_before, second_during) = seen
    assert first_before is None and first_during is not None  # created in the forward, dL/dW summed there
    assert second_before == second_during == first_during == in_place_weight.data_ptr()  # one buffer throughout
    torch.testing.assert_close(in_place_weight, weight_grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(in_place_mix, mix_grad, rtol=0, atol=0)


def test_into_grad_leaves_a_hooked_weight_to_autograd():
    """A tensor hook on the weight sees each backward's own gradient, as without into_grad."""
    calls = {True: [], False: []}
    for into_grad in (True, False):
        seen, _, _ = _tied_micro_batches(into_grad, hook=lambda grad, into=into_grad: calls[into].append(grad.clone()))
        assert seen[0][1] is None  # nothing summed into weight.grad in the forward
    assert len(calls[True]) == len(calls[False]) == 2
    for a, b in zip(calls[True], calls[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_into_grad_refuses_a_scaled_backward_and_gives_the_buffer_back_on_error():
    from grpokit.algorithms import head_token_loss

    weight = torch.randn(VOCAB, 8).requires_grad_()
    hidden, targets = torch.randn(6, 8), torch.randint(0, VOCAB, (6,))
    weight.grad = earlier = torch.ones_like(weight)
    loss, _, _ = head_token_loss(hidden, weight, None, targets, lambda x, e, part: -x.sum(), into_grad=True)
    with pytest.raises(RuntimeError, match="upstream gradient 1, not 0.5"):
        (0.5 * loss).backward()

    def broken(x, e, part):
        raise ValueError("a user's loss fails")

    weight.grad = earlier
    with pytest.raises(ValueError, match="a user's loss fails"):
        head_token_loss(hidden, weight, None, targets, broken, into_grad=True)
    assert weight.grad is earlier


def test_budgeted_forwards_after_the_first_sum_into_the_gradient(tiny_model_dir, tmp_path, monkeypatch):
    """Several forwards a step (a 40-token budget): every forward sums its head's dL/dW into the weight's gradient
    (test_the_loss_does_not_depend_on_the_token_budget shows the values equal)."""
    from grpokit.algorithms import fused_head

    taken = []
    original = fused_head._weight_grad_sum

    def spy(weight, dtype, into_grad):
        result = original(weight, dtype, into_grad)
        taken.append(result[1])
        return result

    monkeypatch.setattr(fused_head, "_weight_grad_sum", spy)
    trainer = train_once(tiny_model_dir, tmp_path, "budget40", token_budget=40)
    assert trainer.forwards == len(taken) > 4 and all(taken)


def test_training_sums_embedding_rows_into_the_gradient_as_the_dense_run(tiny_model_dir, tmp_path, monkeypatch):
    """A single-process run (tied tiny model, 40-token budget): every training forward adds its embedding rows
    into the weight's gradient in place, and the final weights equal a run with autograd's dense gradient."""
    from grpokit.train import learner_step, memory

    calls = []
    original = memory._RowsIntoGrad.backward
    monkeypatch.setattr(memory._RowsIntoGrad, "backward", staticmethod(lambda ctx, g: calls.append(1) or original(ctx, g)))
    rows = train_once(tiny_model_dir, tmp_path, "rows", token_budget=40)
    assert len(calls) == rows.forwards > 4
    monkeypatch.setattr(learner_step, "embedding_rows_into_grad", lambda model: contextlib.nullcontext())
    dense = train_once(tiny_model_dir, tmp_path, "dense", token_budget=40)
    reference = final_weights(dense)
    for name, value in final_weights(rows).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("loss_type, entropy_coef", [(t, 0.01) for t in ("dapo", "grpo", "dr_grpo", "bnpo", "cispo",
                                                                         "sapo", "luspo")]
                         + [("dapo", 0.0), ("grpo", 0.0)])  # no entropy bonus: dL/dz from the softmax left in place
def test_the_loss_inside_the_head_trains_as_the_loss_after_it(tiny_model_dir, tmp_path, monkeypatch, loss_type,
                                                              entropy_coef):
    from grpokit.train.learner import Learner

    options = dict(loss_type=loss_type, beta=0.05, num_iterations=2, entropy_coef=entropy_coef, epsilon_high=0.28)
    calls = []
    fuses = Learner.fuses_loss
    monkeypatch.setattr(Learner, "fuses_loss", lambda self, s: calls.append(fuses(self, s)) or calls[-1])
    fused = train_once(tiny_model_dir, tmp_path, "fused", **options)
    assert calls and all(calls)
    monkeypatch.setattr(Learner, "fuses_loss", lambda self, s: False)
    plain = train_once(tiny_model_dir, tmp_path, "plain", **options)
    for row, expected in zip(fused.state.log_history, plain.state.log_history):
        for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"):
            if key in expected:
                assert math.isclose(row[key], expected[key], rel_tol=2e-4, abs_tol=2e-6), key
    reference = final_weights(plain)
    for name, value in final_weights(fused).items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)


def test_sequence_level_objectives_keep_the_loss_after_the_head(tiny_model_dir, tmp_path):
    from grpokit.algorithms import LossSettings, token_separable

    assert token_separable(LossSettings(policy_objective="clip"))
    assert not token_separable(LossSettings(policy_objective="clip", importance_sampling_level="sequence"))
    assert not token_separable(LossSettings(policy_objective="gmpo"))
    assert not token_separable(LossSettings(policy_objective="vespo"))
    assert not token_separable(LossSettings(policy_objective="clip", off_policy_mask_threshold=0.5))


def test_head_token_loss_under_bf16_autocast_matches_the_loss_after_the_head():
    """Under autocast both paths run the head's products in bf16 (operands cast once per pass) and accumulate
    dL/dW in fp32: they agree to bf16 rounding, and their gradients stay fp32."""
    from grpokit.algorithms import head_logprobs, head_token_loss

    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(30, 32, generator=g).requires_grad_()
    weight = (0.2 * torch.randn(VOCAB, 32, generator=g)).requires_grad_()
    targets = torch.randint(0, VOCAB, (30,), generator=g)
    adv = torch.randn(30, generator=g)
    results = []
    for fused in (True, False):
        hidden.grad = weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                loss, _, _ = head_token_loss(hidden, weight, None, targets, lambda x, e, part: -(x * adv[part]).sum(),
                                             chunk_elements=8 * VOCAB)
            else:
                logp, _ = head_logprobs(hidden, weight, None, targets, chunk_elements=8 * VOCAB)
                loss = -(logp * adv).sum()
        loss.backward()
        assert weight.grad.dtype == hidden.grad.dtype == torch.float32
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, rtol=2e-2, atol=2e-3)


def test_packing_is_chosen_where_it_saves_positions(monkeypatch):
    from grpokit.passes import PassResult, dispatch

    monkeypatch.setattr(dispatch, "PACK_WHEN", 0.8)
    model = family_model("qwen2")
    seen = []
    monkeypatch.setattr(dispatch, "packed_pass", lambda *a, **k: seen.append(True) or PassResult(None))
    equal = ragged_batch(prompts=((5, 8),), completions=(9,) * 8)  # one prompt, equal lengths: nothing to save
    completion_logprobs(model, *equal)
    assert seen == []
    spread = ragged_batch(prompts=((5, 4), (5, 4)), completions=(60, 1, 2, 3, 1, 2, 3, 4))
    completion_logprobs(model, *spread)
    assert seen == [True]

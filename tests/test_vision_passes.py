"""Image prompts through the passes and the decode loop (grpokit/vision, grpokit/passes, grpokit/rollout), for
every family of grpokit.tiny_vision: each distinct prompt's images are encoded once for all its completions, and the
log-probs, their gradients and greedy generation equal what the model computes for each sample alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from grpokit.passes import PassRequest, Tokens
from grpokit.passes.dispatch import run_pass
from grpokit.rollout.engine import SamplingParams
from grpokit.rollout.generate import generate_completions, left_pad
from grpokit.tiny_vision import FAMILIES
from grpokit.vision import encode_prompt, with_image_parts
from grpokit.vision.model_inputs import forward_inputs, placeholder_ids, rope_positions

TOWERS = ("visual", "vision_tower", "vision_model")


def picture(width: int = 56, height: int = 56, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    torch.manual_seed(0)
    model, processor = FAMILIES[request.param]()
    # three prompts: two with the same text and same-sized but different images (equal ids), one wider image
    specs = [("count", picture(56, 56, 1)), ("what colour is it?", picture(84, 56, 2)), ("count", picture(56, 56, 3))]
    prompts = [encode_prompt(processor, with_image_parts(text, [image], f"row {k}"))
               for k, (text, image) in enumerate(specs)]
    return request.param, model, processor, prompts


def batch(processor, prompts, rows=(0, 0, 1, 1, 2, 2), texts=("abc", "ab", "abcd", "a", "abc", "cab")):
    tok = processor.tokenizer
    completions = [tok.convert_tokens_to_ids(list(t)) for t in texts]
    prompt_ids, prompt_mask = left_pad([prompts[r][0] for r in rows], tok.pad_token_id)
    width = max(map(len, completions))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, c in enumerate(completions):
        ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
    return Tokens(prompt_ids, prompt_mask, ids, mask, tuple(prompts[r][1] for r in rows)), completions, list(rows)


def alone(model, prompts, completions, rows):
    """Each sample's log-probs from its own forward, positions as the model computes them itself."""
    out = []
    for completion, r in zip(completions, rows):
        ids, vision = prompts[r]
        full = torch.tensor(ids + completion)[None]
        extra = forward_inputs([vision], torch.ones(1, len(ids), dtype=torch.long), len(completion))
        logits = model(input_ids=full, **extra).logits[0, len(ids) - 1 : -1].float()
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0])
    return out


def alone_with_gradients(model, prompts, completions, rows):
    """`alone`'s log-probs (train mode) and the gradients of their sum, {name: grad}; the model's grads zeroed."""
    model.train()
    model.zero_grad()
    reference = alone(model, prompts, completions, rows)
    sum(r.sum() for r in reference).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return reference, expected


def tower(model):
    inner = model.model
    return next(getattr(inner, name) for name in TOWERS if hasattr(inner, name))


@pytest.mark.parametrize("share, images", [(True, True), (False, True), (False, False)])
def test_log_probs_and_gradients_equal_each_sample_alone(family, share, images):
    """The padded pass with prompts shared through the KV cache, or each row whole with its prompt's images
    encoded once (mm_encoder_outputs gathered per row) or once per row."""
    name, model, processor, prompts = family
    tokens, completions, rows = batch(processor, prompts)
    reference, expected = alone_with_gradients(model, prompts, completions, rows)
    logp = run_pass(model, tokens, PassRequest(share_prompts=share, share_images=images, pack=False)).logprobs
    (logp * tokens.completion_mask).sum().backward()
    for i, r in enumerate(reference):
        torch.testing.assert_close(logp[i, : len(r)].detach(), r.detach(), atol=1e-5, rtol=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys()
    assert any(n.startswith(("model.visual", "model.vision_tower", "model.vision_model")) for n in got)
    for n, g in expected.items():
        torch.testing.assert_close(got[n], g, atol=1e-5, rtol=1e-4, msg=n)
    model.zero_grad()


def test_each_distinct_prompt_is_encoded_once_per_pass(family):
    """Six rows of three prompts: the shared pass runs the vision tower over the three prompts' images once; two
    prompts with equal ids (same text, same-sized images) but different images are not merged."""
    name, model, processor, prompts = family
    tokens, _, _ = batch(processor, prompts)
    assert prompts[0][0] == prompts[2][0] and prompts[0][1].key != prompts[2][1].key
    calls = []
    handle = tower(model).register_forward_hook(lambda m, i, o: calls.append(1))
    try:
        with torch.no_grad():
            shared = run_pass(model, tokens, PassRequest(share_prompts=True, pack=False)).logprobs
            plain = run_pass(model, tokens, PassRequest(share_prompts=False, pack=False)).logprobs
    finally:
        handle.remove()
    assert len(calls) == 2  # one tower call per forward that reads prompts: the shared pass's one, the plain one
    mask = tokens.completion_mask.bool()
    torch.testing.assert_close(shared[mask], plain[mask], atol=1e-5, rtol=1e-5)
    # rows 0 and 4: the same prompt ids and the same completion, but other images
    assert torch.equal(tokens.completion_ids[0], tokens.completion_ids[4])
    assert not torch.allclose(shared[0, :3], shared[4, :3], atol=1e-4)


def test_encoded_images_count_distinct_prompts_not_rows(family):
    """What the tower sees: the three prompts' pixels in the shared pass and in the per-row pass with
    share_images; every row's (each prompt has two rows: twice as many) with share_images off."""
    name, model, processor, prompts = family
    tokens, _, _ = batch(processor, prompts)
    seen = []
    hook = tower(model).register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        (args[0] if args else next(iter(kwargs.values()))).shape[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            run_pass(model, tokens, PassRequest(share_prompts=True, pack=False))
            run_pass(model, tokens, PassRequest(share_prompts=False, pack=False))
            run_pass(model, tokens, PassRequest(share_prompts=False, share_images=False, pack=False))
    finally:
        hook.remove()
    assert len(seen) == 3 and seen[0] == seen[1] and seen[2] == 2 * seen[0]


def test_greedy_generation_equals_transformers_generate(family):
    name, model, processor, prompts = family
    model.eval()
    rows = [0, 0, 1, 1, 2]
    params = SamplingParams(max_completion_length=10, top_k=1)
    out = generate_completions(model, processor.tokenizer, [prompts[r][0] for r in rows], torch.arange(5), params, 0,
                               vision=[prompts[r][1] for r in rows])
    for k, r in enumerate(rows):
        ids, vision = prompts[r]
        extra = forward_inputs([vision], torch.ones(1, len(ids), dtype=torch.long))
        reference = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=10, suppress_tokens=placeholder_ids(model), pad_token_id=processor.tokenizer.pad_token_id,
            **extra)[0, len(ids):]
        mine = out.completion_ids[k][out.completion_mask[k].bool()]
        assert mine.tolist() == reference[: len(mine)].tolist()
        assert not set(mine.tolist()) & set(placeholder_ids(model))


def test_positions_are_computed_per_sample_never_from_the_models_stored_deltas(family):
    """A pass after another batch (the model's own rope_deltas left stale, transformers#44873) gives the same
    log-probs as on a fresh model."""
    name, model, processor, prompts = family
    tokens, _, _ = batch(processor, prompts, rows=(1, 1), texts=("ab", "ba"))
    with torch.no_grad():
        before = run_pass(model, tokens, PassRequest()).logprobs
        other, _, _ = batch(processor, prompts, rows=(0, 2, 2), texts=("abcab", "a", "ca"))
        run_pass(model, other, PassRequest())
        if hasattr(model.model, "rope_deltas"):
            model.model.rope_deltas = torch.full((3, 1), 7)
        after = run_pass(model, tokens, PassRequest()).logprobs
    assert torch.equal(before, after)


def test_mrope_positions_resume_after_the_image(family):
    name, model, processor, prompts = family
    ids, vision = prompts[0]  # a 2 x 2 grid of merged patches: 4 tokens over 2 positions
    positions = rope_positions(model, [vision], torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long), 3)
    if not name.startswith("qwen"):
        assert positions is None
        return
    reference, _ = model.model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=vision.token_fields["mm_token_type_ids"][None],
        image_grid_thw=vision.tensors["image_grid_thw"])
    assert torch.equal(positions[:, :, : len(ids)], reference)
    last = int(reference[0, 0, -1])
    assert positions[:, 0, len(ids):].tolist() == [[last + 1, last + 2, last + 3]] * 3
    assert last + 1 < len(ids)  # the image's grid made the positions shorter than the tokens


def packed(model, tokens, request=PassRequest()):
    """The packed path itself (whatever run_pass would pick): every sample in rows of one plan."""
    from grpokit.passes import packing
    from grpokit.passes.dispatch import packed_pass
    from grpokit.passes.forward import distinct_rows, output_head, vision_ids

    groups = distinct_rows(tokens.prompt_ids, tokens.prompt_mask, vision_ids(list(tokens.vision)))[1].tolist()
    prompts, completions = (t.tolist() for t in packing.lengths(tokens.prompt_mask, tokens.completion_mask))
    layout = packing.plan(groups, prompts, completions, capacity=2 * max(prompts) + 6)  # two prompts a row at most
    assert len({g for row in layout.rows for g, _ in row}) == 3  # rows 0 and 4 (equal ids) stay two prompts
    return packed_pass(model, output_head(model), tokens, request.resolved(), layout)


def test_packed_rows_with_images_equal_each_sample_alone(family):
    """Padding-free packing with images: prompts laid out once per row with their images in row order, per-token
    fields placed, multimodal-RoPE positions per sample; log-probs and gradients as each sample's own forward.
    Gemma 3 does not pack (sliding-window layers)."""
    from grpokit.passes.forward import packs

    name, model, processor, prompts = family
    if name == "gemma3":
        assert not packs(model)
        return
    assert packs(model)
    tokens, completions, rows = batch(processor, prompts)
    reference, expected = alone_with_gradients(model, prompts, completions, rows)
    logp = packed(model, tokens).logprobs
    (logp * tokens.completion_mask).sum().backward()
    for i, r in enumerate(reference):
        torch.testing.assert_close(logp[i, : len(r)].detach(), r.detach(), atol=1e-5, rtol=1e-5)
    for n, g in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, atol=1e-5, rtol=1e-4, msg=n)
    model.zero_grad()

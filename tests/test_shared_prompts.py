"""The shared-prompt forward gives the logits and gradients of one full forward per row."""

import torch

from grpokit.passes import Tokens, distinct_rows
from grpokit.passes.forward import completion_logits
from grpokit.tiny import tiny_qwen2


def test_distinct_rows_maps_each_row_to_its_first_copy():
    ids = torch.tensor([[3, 4], [5, 6], [3, 4], [5, 6], [0, 6]])
    mask = (ids != 0).long()
    first, inverse = distinct_rows(ids, mask)
    assert torch.equal(ids[first][inverse], ids)
    assert sorted(first.tolist()) == [0, 1, 4]


def test_shared_prompt_forward_matches_full_forward_with_left_padding_and_early_eos():
    model = tiny_qwen2(40, hidden_size=32, num_layers=2, seed=0).train()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, 40, (1, 6), generator=g)
    b = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.randint(2, 40, (1, 4), generator=g)], 1)  # padded
    prompts = torch.cat([a.repeat(3, 1), b.repeat(3, 1)])
    prompt_mask = (prompts != 0).long()
    completions = torch.randint(2, 40, (6, 9), generator=g)
    completion_mask = torch.ones_like(completions)
    completion_mask[0, 5:] = 0
    weights = torch.randn(6, 9, 40, generator=g) * completion_mask.unsqueeze(-1)
    results = []
    for share in (False, True):
        model.zero_grad()
        logits = completion_logits(model, Tokens(prompts, prompt_mask, completions, completion_mask), share_prompts=share)
        (logits * weights).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    (plain, plain_grads), (shared, shared_grads) = results
    valid = completion_mask.bool()
    torch.testing.assert_close(shared[valid], plain[valid], rtol=1e-5, atol=1e-5)
    for x, y in zip(shared_grads, plain_grads):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)

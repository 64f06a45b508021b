"""Padding-free packing: the samples of a forward laid end to end in rows, each distinct prompt once per row.

A GRPO batch holds G completions of each prompt, of very different lengths. The padded layout gives every sample
a row as wide as the longest prompt plus the longest completion; here a row holds whole samples back to back:

    row:  [prompt u][completion i][completion j][prompt v][completion k] ... [tail padding]
    pos:   0..p_u-1  p_u..p_u+l_i-1  p_u..p_u+l_j-1  0..p_v-1 ...

Completion i of prompt u sees the prompt tokens and its own earlier tokens, nothing else (a block-causal mask with
shared prefixes, built here as a (R, 1, L, L) mask); its positions continue the prompt's, so every token is computed
as in its own padded row: packing changes the order of floating-point operations, not the function. Completion
token t of sample i is predicted by the hidden state at its predecessor: the prompt's last token for t = 0, else
completion token t - 1 (`Pack.source`).

Rows are planned first-fit: each sample goes to the first row that has its prompt and room for its completion, or
room for both. A row's attention costs L^2 (every pair is computed, then masked), so its capacity is the longest
sample or the model's `row_tokens` (where attention would cost a quarter of a token's other work, at most
ROW_TOKENS), whichever is larger, never a whole forward's token budget; then the rows are evened out (the same
number of rows at the smallest capacity first-fit allows), since every row of a forward is as wide as its widest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROW_TOKENS = 2048  # the largest row capacity row_tokens gives (a longer sample still gets a row of its length)


def row_tokens(config) -> int:
    """A row's capacity for a model: the width L at which a token's attention (4 L H flops a layer, the L keys
    computed then masked) costs a quarter of its other work (the layers' products, 2 (4 H^2 + 3 H I) a layer, and
    the head's 2 V H for the completion tokens, taken as half the row):
    L = (8 H + 6 I) / 16 + V / (16 layers), at most ROW_TOKENS. A 43M-parameter model at a 151,936-entry
    vocabulary gets 2048; a tiny model with a character vocabulary about 100, so its rows are as wide as its
    longest sample (never more than the padded layout's width)."""
    hidden = getattr(config, "hidden_size", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not hidden or not layers:
        return ROW_TOKENS
    inner = getattr(config, "intermediate_size", None) or 4 * hidden
    vocab = getattr(config, "vocab_size", 0) or 0
    return int(min(ROW_TOKENS, (8 * hidden + 6 * inner) / 16 + vocab / (16 * layers)))


@dataclass(frozen=True)
class Layout:
    """Where the samples go. rows[r] is a list of (u, samples): prompt u then those samples' completions."""

    rows: list[list[tuple[int, list[int]]]]
    width: int  # L, the longest row's tokens
    fills: list[int]  # each row's tokens


@dataclass(frozen=True)
class Pack:
    """A packed forward's inputs and how to read its outputs back into (b, T).

    input_ids, position_ids: (R, L); groups: (R, L) which prompt's block each token is in (a tail padding token:
    a block of its own); segments: (R, L) 0 for a prompt token, s for the block's s-th completion;
    source: (n,) flat index into R * L of the position that predicts each completion token;
    sample, offset: (n,) that token's sample and position in its completion (the (b, T) cell it fills)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    groups: torch.Tensor
    segments: torch.Tensor
    source: torch.Tensor
    sample: torch.Tensor
    offset: torch.Tensor


def lengths(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(b,) prompt and completion token counts of left-padded prompts and right-padded completions."""
    return prompt_mask.sum(-1).long(), completion_mask.sum(-1).long()


def packable(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> bool:
    """The layouts this packer reads: every prompt left-padded and non-empty, every completion mask a run of ones
    from position 0 (right padding only)."""
    prompts, completions = lengths(prompt_mask, completion_mask)
    if prompt_mask.shape[0] == 0 or bool((prompts == 0).any()):
        return False
    width = prompt_mask.shape[1]
    left = torch.arange(width, device=prompt_mask.device) >= (width - prompts).unsqueeze(-1)
    right = torch.arange(completion_mask.shape[1], device=completion_mask.device) < completions.unsqueeze(-1)
    return bool((prompt_mask.bool() == left).all()) and bool((completion_mask.bool() == right).all())


def plan(groups: list[int], prompt_lengths: list[int], completion_lengths: list[int], capacity: int) -> Layout:
    """Rows of at most max(capacity, longest sample) tokens, as few as first-fit makes, then as even as that
    number of rows allows (the rows of a forward are as wide as its widest: an uneven last row is padding).

    groups[i]: sample i's prompt (equal numbers: one prompt); prompt_lengths[i], completion_lengths[i]: its
    tokens. A prompt appears once in every row holding one of its samples."""
    longest = max([p + c for p, c in zip(prompt_lengths, completion_lengths)], default=0)
    layout = _first_fit(groups, prompt_lengths, completion_lengths, max(capacity, longest))
    count = len(layout.rows)
    target = max(longest, -(-sum(layout.fills) // max(count, 1)))
    while target < layout.width:
        even = _first_fit(groups, prompt_lengths, completion_lengths, target)
        if len(even.rows) <= count:
            return even
        target = max(target + 1, target * 21 // 20)
    return layout


def _first_fit(groups, prompt_lengths, completion_lengths, capacity: int) -> Layout:
    """Each sample into the first row that has its prompt and room for its completion, or room for both."""
    rows: list[list[tuple[int, list[int]]]] = []
    used: list[int] = []
    for i, (u, p, c) in enumerate(zip(groups, prompt_lengths, completion_lengths)):
        placed = False
        for r, row in enumerate(rows):
            block = next((b for b in row if b[0] == u), None)
            cost = c if block is not None else p + c
            if used[r] + cost <= capacity:
                if block is None:
                    row.append((u, [i]))
                else:
                    block[1].append(i)
                used[r] += cost
                placed = True
                break
        if not placed:
            rows.append([(u, [i])])
            used.append(p + c)
    return Layout(rows, max(used, default=0), used)


def build(layout: Layout, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
          completion_mask: torch.Tensor, pad_id: int = 0) -> Pack:
    """The packed tensors of `layout` for (b, P) left-padded prompts and (b, T) right-padded completions."""
    prompts, completions = lengths(prompt_mask, completion_mask)
    prompts, completions = prompts.tolist(), completions.tolist()
    width, count = layout.width, len(layout.rows)
    ids = torch.full((count, width), pad_id, dtype=completion_ids.dtype)
    positions = torch.zeros((count, width), dtype=torch.long)
    groups = torch.empty((count, width), dtype=torch.long)
    segments = torch.zeros((count, width), dtype=torch.long)
    source, sample, offset = [], [], []
    prompt_ids, completion_ids = prompt_ids.cpu(), completion_ids.cpu()
    block_id = 0
    for r, row in enumerate(layout.rows):
        at = 0
        for _, members in row:
            first = members[0]
            p = prompts[first]
            ids[r, at : at + p] = prompt_ids[first, prompt_ids.shape[1] - p :]
            positions[r, at : at + p] = torch.arange(p)
            groups[r, at : at + p] = block_id
            last_prompt = r * width + at + p - 1
            at += p
            for s, i in enumerate(members, start=1):
                c = completions[i]
                ids[r, at : at + c] = completion_ids[i, :c]
                positions[r, at : at + c] = torch.arange(p, p + c)
                groups[r, at : at + c] = block_id
                segments[r, at : at + c] = s
                if c:
                    source.append(torch.cat([torch.tensor([last_prompt]), r * width + at + torch.arange(c - 1)]))
                    sample.append(torch.full((c,), i))
                    offset.append(torch.arange(c))
                at += c
            block_id += 1
        tail = width - at  # padding attends to itself only: finite, and seen by no real token
        groups[r, at:] = torch.arange(block_id, block_id + tail)
        block_id += tail
    empty = torch.zeros(0, dtype=torch.long)
    cat = (lambda parts: torch.cat(parts) if parts else empty)  # noqa: E731
    return Pack(ids, positions, groups, segments, cat(source), cat(sample), cat(offset))


def unshared(samples: list[int], groups: list[int], prompt_lengths: list[int],
             completion_lengths: list[int]) -> Layout:
    """`samples` in one row, each with its own copy of its prompt (groups[i]: sample i's prompt), in that order:
    the layout of attention kernels that take sequence boundaries instead of a mask (flash-attention's varlen
    `cu_seqlens`), in which a token sees only the earlier tokens of its own sequence, so a prompt cannot be shared.
    No padding: the row holds sum_i (prompt_i + completion_i) tokens."""
    fill = sum(prompt_lengths[i] + completion_lengths[i] for i in samples)
    return Layout([[(groups[i], [i]) for i in samples]], fill, [fill])


def boundaries(pack: Pack) -> tuple[torch.Tensor, int]:
    """(S + 1,) int32 offsets where the S sequences of a one-row `unshared` pack start (and its end), and the
    longest sequence's tokens: flash-attention's cu_seqlens and max_seqlen. A sequence starts at position 0."""
    positions = pack.position_ids.reshape(-1)
    starts = (positions == 0).nonzero().view(-1)
    offsets = torch.cat([starts, torch.tensor([positions.shape[0]])]).to(torch.int32)
    return offsets, int((offsets[1:] - offsets[:-1]).max()) if offsets.shape[0] > 1 else 0


def attention_mask(pack: Pack, dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """(R, 1, L, L) mask: query q sees key k when both are in one prompt's block, k <= q, and k is a prompt token
    or in q's completion. Boolean (True: seen), or additive in `dtype` (0 seen, dtype's minimum not) for
    attention implementations that add the mask to the scores."""
    groups, segments = pack.groups.to(device), pack.segments.to(device)
    width = groups.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    same = groups.unsqueeze(2) == groups.unsqueeze(1)  # (R, L, L)
    visible = (segments.unsqueeze(1) == 0) | (segments.unsqueeze(2) == segments.unsqueeze(1))
    mask = (same & visible & causal).unsqueeze(1)
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, torch.finfo(dtype).min)


@dataclass(frozen=True)
class Forward:
    """One forward of a token-budgeted step: `samples` (indices into the step's rows) and their rows, in which
    sample numbers are positions in `samples`. A filler forward (`weight` 0) only keeps the processes' forward
    counts equal: its loss is multiplied by 0."""

    samples: list[int]
    layout: Layout
    weight: float = 1.0


def budget_forwards(groups: list[int], prompt_lengths: list[int], completion_lengths: list[int],
                    budget: int, row_capacity: int | None = None) -> list[Forward]:
    """The samples cut into forwards of at most `budget` forwarded tokens (rows x the widest row, padding
    included), a sample never split, each prompt once per row.

    Rows (capacity min(row_capacity (default ROW_TOKENS), budget)) are sorted by their tokens, longest first,
    and each forward takes the next rows while rows x width stays within the budget: rows of similar width share
    a forward, so little padding is forwarded and forwards of long rows hold few of them (attention costs width^2
    per row)."""
    longest = max((p + c for p, c in zip(prompt_lengths, completion_lengths)), default=0)
    if longest > budget:
        raise ValueError(f"a sample of {longest} tokens does not fit token_budget={budget}")
    capacity = ROW_TOKENS if row_capacity is None else row_capacity
    layout = plan(groups, prompt_lengths, completion_lengths, min(capacity, budget))
    fills = layout.fills
    order = sorted(range(len(layout.rows)), key=lambda r: -fills[r])
    chosen: list[list[int]] = []
    for r in order:
        if chosen and (len(chosen[-1]) + 1) * fills[chosen[-1][0]] <= budget:
            chosen[-1].append(r)
        else:
            chosen.append([r])
    return [_forward([layout.rows[r] for r in rows], [fills[r] for r in rows]) for rows in chosen]


def _forward(rows: list[list[tuple[int, list[int]]]], fills: list[int], weight: float = 1.0) -> Forward:
    samples = [i for row in rows for _, members in row for i in members]
    local = {i: k for k, i in enumerate(samples)}
    renumbered = [[(u, [local[i] for i in members]) for u, members in row] for row in rows]
    return Forward(samples, Layout(renumbered, max(fills), list(fills)), weight)


def equalize(forwards: list[Forward], count: int) -> list[Forward]:
    """`count` forwards (>= len(forwards)): the forwards with most rows split in two, then fillers of weight 0
    (a repeat of the smallest forward) when every forward is one row. Processes run as many forwards as the one
    with most, because every forward of a sharded or data-parallel model is a collective."""
    forwards = list(forwards)
    while len(forwards) < count:
        split = max(range(len(forwards)), key=lambda k: len(forwards[k].layout.rows), default=None)
        if split is None or len(forwards[split].layout.rows) < 2:
            break
        whole = forwards.pop(split)
        rows = [[(u, [whole.samples[i] for i in m]) for u, m in row] for row in whole.layout.rows]
        half = len(rows) // 2
        fills = whole.layout.fills
        forwards[split:split] = [_forward(rows[:half], fills[:half]), _forward(rows[half:], fills[half:])]
    while len(forwards) < count:
        smallest = min(forwards, key=lambda f: len(f.samples))
        forwards.append(Forward(smallest.samples, smallest.layout, 0.0))
    return forwards

"""steps_per_generation that is not a multiple of gradient_accumulation_steps, as TRL 1.16 trains it: micro-batch k
of a run is part k mod steps_per_generation of generation batch k // (steps_per_generation x num_iterations), and
each optimizer step takes the next gradient_accumulation_steps micro-batches (TRL's GRPOTrainer._prepare_inputs,
whose `_step` counts micro-batches)."""

import math

import pytest
import torch

from grpokit.train.batches import Experience
from grpokit.train.pipeline import ExperienceBuffer
from grpokit.trainer import GRPOTrainer
from helpers import frac_a
from test_trainer import config, read_jsonl

SIZE = 2  # rows per micro-batch


def trl_order(spg: int, iterations: int, accumulation: int, steps: int) -> list[list[tuple[int, int]]]:
    """TRL's (generation batch, part) of each micro-batch, grouped by optimizer step."""
    micro = [(k // (spg * iterations), k % spg) for k in range(steps * accumulation)]
    return [micro[i:i + accumulation] for i in range(0, len(micro), accumulation)]


def generation(index: int, spg: int) -> Experience:
    """A generation batch whose rows say where they come from: completion token = 1000 x batch + row; widths
    differ between batches, so joining them pads."""
    rows, width, prompt = spg * SIZE, 2 + index % 3, 1 + index % 2
    completion = torch.arange(rows).unsqueeze(1).repeat(1, width) + 1000 * index
    ones = torch.ones(rows, width, dtype=torch.long)
    return Experience(torch.full((rows, prompt), 7), torch.ones(rows, prompt, dtype=torch.long), completion, ones,
                      ones.clone(), torch.arange(rows, dtype=torch.float) + index, old_logp=torch.zeros(rows, width))


def grpokit_order(spg: int, iterations: int, accumulation: int, steps: int) -> list[list[tuple[int, int]]]:
    """The buffer's micro-batches as the trainer takes them, read back from the rows' own labels."""
    buffer, made, order = ExperienceBuffer(spg, iterations, accumulation, SIZE, rank=0), 0, []
    for _ in range(steps):
        while buffer.left < accumulation:
            buffer.put(generation(made, spg))
            made += 1
        experience, slices = buffer.take(accumulation)
        step = []
        for rows in slices:
            width = int(experience.completion_mask[rows].sum(-1).max())  # what Learner.micro_batch_loss keeps
            ids = experience.completion_ids[rows, :width]
            assert (ids == ids[:, :1]).all() and width == 2 + int(ids[0, 0]) // 1000 % 3  # padding trimmed away
            labels = ids[:, 0].tolist()
            batch, first = labels[0] // 1000, labels[0] % 1000
            assert labels == [1000 * batch + first + r for r in range(SIZE)] and first % SIZE == 0
            step.append((batch, first // SIZE))
        order.append(step)
    return order


@pytest.mark.parametrize("spg, iterations, accumulation", [
    (3, 1, 2), (2, 1, 3), (1, 1, 2), (1, 1, 4), (4, 2, 3), (3, 2, 2), (2, 1, 2), (4, 1, 2), (1, 3, 2), (5, 1, 3),
])
def test_micro_batches_come_in_trls_order(spg, iterations, accumulation):
    steps = 2 * spg * iterations * accumulation  # several full cycles
    assert grpokit_order(spg, iterations, accumulation, steps) == trl_order(spg, iterations, accumulation, steps)


def test_a_step_across_generation_batches_joins_them_and_the_buffer_checkpoints_one(tmp_path):
    buffer = ExperienceBuffer(3, 1, 2, SIZE, rank=0)
    buffer.put(generation(0, 3))
    first, _ = buffer.take()
    assert buffer.left == 1 and buffer.cursor == 2
    buffer.put(generation(1, 3))
    joined, slices = buffer.take()  # part 2 of batch 0, then part 0 of batch 1
    assert joined.completion_ids.shape == (4, 3) and slices == [slice(0, 2), slice(2, 4)]
    assert joined.prompt_mask[:2].tolist() == [[0, 1], [0, 1]]  # batch 0's prompts, left-padded to batch 1's width
    buffer.save(tmp_path)
    restored = ExperienceBuffer(3, 1, 2, SIZE, rank=0)
    restored.load(tmp_path)
    assert restored.cursor == 1 and restored.left == 2
    assert torch.equal(restored.experience.completion_ids, generation(1, 3).completion_ids)


def test_a_run_with_steps_not_lined_up_with_generations(tmp_path, tiny_model_dir, prompt_dataset):
    # 3 micro-batches a generation, 2 a step: 3 steps use 2 generation batches; the second step spans both
    args = config(tmp_path, max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  steps_per_generation=3)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
    assert trainer.setup.geometry.reuses_batch  # batch 0's last part trains after step 1: old log-probs needed
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    taken = []
    original = trainer.learner.step
    trainer.learner.step = lambda exp, rows, coef: taken.append((exp.old_logp is not None, len(rows))) or \
        original(exp, rows, coef)
    state = trainer.train()
    assert state.global_step == 3 and state.generations == 2 and trainer.buffer.empty
    assert taken == [(True, 2)] * 3
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_several_generation_batches_in_one_step(tmp_path, tiny_model_dir, prompt_dataset):
    args = config(tmp_path, max_steps=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  steps_per_generation=1)
    args.log_completions, args.completions_logging_steps = True, 1
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset)
    assert not trainer.setup.geometry.reuses_batch  # both batches of a step are sampled by the step's weights
    batches, original = [], trainer.telemetry.generation_metrics
    trainer.telemetry.generation_metrics = lambda *a: batches.append(original(*a)) or batches[-1]
    state = trainer.train()
    assert state.global_step == 2 and state.generations == 4
    assert all(math.isfinite(row["loss"]) for row in state.log_history if "loss" in row)
    # each step logs both batches it trained on, not only the newer one
    rows = [row for row in state.log_history if "loss" in row]
    for row, pair in zip(rows, (batches[0:2], batches[2:4])):
        assert row["reward"] == pytest.approx(sum(b["reward"] for b in pair) / 2, abs=1e-12)
        assert row["completions/max_length"] == max(b["completions/max_length"] for b in pair)
        assert row["num_tokens"] == pair[1]["num_tokens"] > pair[0]["num_tokens"]
    assert rows[-1]["num_tokens"] == state.num_input_tokens_seen
    logged = read_jsonl(tmp_path / "out" / "completions.jsonl")
    assert [r["step"] for r in logged] == [1] * 8 + [2] * 8  # 4 completions a batch, two batches a step


def test_an_epochs_run_ends_with_the_micro_batches_left(tmp_path, tiny_model_dir, prompt_dataset):
    # 9 prompts, 3 a generation batch of 3 micro-batches: 9 micro-batches, 2 a step -> 5 steps, the last with 1
    args = config(tmp_path, max_steps=-1, num_train_epochs=1, per_device_train_batch_size=4,
                  gradient_accumulation_steps=2, steps_per_generation=3)
    trainer = GRPOTrainer(tiny_model_dir, frac_a, args, prompt_dataset.select(range(9)))
    sizes = []
    original = trainer.learner.step
    trainer.learner.step = lambda exp, rows, coef: sizes.append(len(rows)) or original(exp, rows, coef)
    state = trainer.train()
    assert state.max_steps == 5 and sizes == [2, 2, 2, 2, 1] and state.generations == 3 and state.epoch == 1.0

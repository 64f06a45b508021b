"""The asynchronous producer as a state machine (grpokit/train/asynchronous.py's module docstring), the trainer state
reward functions get from it, and the shadow policy's load checks (grpokit/train/shadow.py).

- reward functions get the loop's full TrainerState, asynchronously as synchronously (max_steps, epoch, ...);
- Ahead driven by hand with a fake collector: the phases, what quiesce guarantees, what publish changes, who
  counts the rounds generated, a failure and the end of the run;
- ShadowPolicy.load raises, naming them, on tensors it cannot place or a snapshot that lacks some.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import datasets
import pytest
import torch

from grpokit.config import GRPOConfig
from grpokit.data import SamplerState
from grpokit.train.asynchronous import Ahead, Phase, ShadowPolicy, Snapshot, shadow_copy, take_snapshot
from grpokit.train.batches import TrainerState
from grpokit.trainer import GRPOTrainer
from helpers import short


# ---------------------------------------------------------------------- the trainer state reward functions get
def _run(tmp_path, name, model_dir, reward, **overrides):
    values = dict(output_dir=str(tmp_path / name), max_steps=5, num_generations=4, per_device_train_batch_size=8,
                  max_completion_length=8, learning_rate=0.0, disable_tqdm=True, seed=0, logging_steps=1,
                  report_to="none")
    values.update(overrides)
    dataset = datasets.Dataset.from_list([{"prompt": f"{i}+{i}="} for i in range(16)])
    trainer = GRPOTrainer(model_dir, [reward], GRPOConfig(**values), dataset)
    trainer.train()
    return trainer


def _recording(seen):
    def scheduled(prompts, completions, trainer_state, **kwargs):
        """A reward on a schedule: it divides by max_steps."""
        weight = 1.0 - trainer_state.global_step / trainer_state.max_steps
        state = dataclasses.asdict(trainer_state)
        seen.append({**state, "log_history": len(state["log_history"]), "thread": threading.current_thread().name})
        return [weight * value for value in short(prompts, completions)]
    return scheduled


def test_reward_functions_get_the_loops_full_trainer_state_asynchronously_too(tmp_path, tiny_model_dir):
    """max_staleness 1 gives the reward functions of batch b the loop's state as published with the weights that
    make it (step max(0, b - 1)): max_steps and epoch included, as the synchronous loop gives them at that step."""
    runs = {}
    for k in (0, 1):
        seen = []
        _run(tmp_path, f"k{k}", tiny_model_dir, _recording(seen), max_staleness=k)
        runs[k] = seen
    sync, ahead = runs[0], runs[1]
    assert [s["max_steps"] for s in sync + ahead] == [5] * 10
    assert {s["thread"] for s in ahead} == {"grpokit-rollouts"}
    assert [s["global_step"] for s in sync] == [0, 1, 2, 3, 4]
    assert [s["global_step"] for s in ahead] == [0, 0, 1, 2, 3]  # batch b: the weights of step max(0, b - 1)
    assert [s["generations"] for s in ahead] == [s["generations"] for s in sync] == [1, 2, 3, 4, 5]
    assert [s["epoch"] for s in sync] == [0.0, 0.125, 0.25, 0.375, 0.5]
    at_step = {s["global_step"]: s for s in sync}
    for state in ahead:  # every other field as the loop had it at that step (lr 0: the same completions)
        expected = {**at_step[state["global_step"]], "thread": "grpokit-rollouts", "generations": state["generations"]}
        assert state == expected


# ---------------------------------------------------------------------- Ahead by hand
class FakeCollector:
    """What Ahead uses of a Collector: `policy`, `pulse`, `sampler` and `collect` (bumps state.generations once,
    as one round does). `gate`: collect waits for it; `fail_at`: the batch that raises."""

    def __init__(self, policy, fail_at=None):
        self.policy, self.pulse, self.fail_at = policy, None, fail_at
        self.sampler = SimpleNamespace(epoch_progress=0.0, state=SamplerState())
        self.states: list[TrainerState] = []
        self.gate = threading.Event()
        self.gate.set()

    def collect(self, state):
        self.gate.wait(timeout=30)
        index = len(self.states)
        if index == self.fail_at:
            raise ValueError(f"batch {index} failed on purpose")
        self.states.append(dataclasses.replace(state))
        state.generations += 1
        self.sampler.epoch_progress += 0.25
        return SimpleNamespace(rows=list(range(4)), index=index)


def _ahead(staleness=1, fail_at=None, queue=1024):
    model = torch.nn.Linear(2, 2)
    learner = SimpleNamespace(unwrapped=model, version=0)
    collector = FakeCollector(ShadowPolicy(shadow_copy(model), 0), fail_at)
    args = SimpleNamespace(max_staleness=staleness, weight_sync_steps=1, queue_maxsize=queue,
                           heartbeat_stale_after_s=30.0)
    return Ahead(collector, learner, 1, 1, args), collector, learner


def _step(pipeline, state, learner):
    """One step of the loop: take a batch, train (the weights move), quiesce, publish."""
    batch = pipeline.next(state)
    with torch.no_grad():
        learner.unwrapped.weight.add_(1.0)
    learner.version += 1
    state.global_step += 1
    state.epoch = pipeline.epoch
    pipeline.quiesce()
    pipeline.publish(state)
    return batch


def test_the_producer_moves_through_its_phases_and_quiesce_leaves_nothing_half_made():
    pipeline, collector, learner = _ahead(staleness=1)
    state = TrainerState(max_steps=4, entropy_coef=0.5)
    assert pipeline.shared.phase is Phase.STOPPED
    pipeline.start(state, total_micro_batches=4)
    pipeline.quiesce()  # k = 1: batches 0 and 1 are made with the weights of step 0, batch 2 waits for step 1's
    shared = pipeline.shared
    assert shared.phase is Phase.WAITING and [m.index for m in shared.made] == [0, 1]
    assert [m.step for m in shared.made] == [0, 0] and shared.next_index == 2
    assert shared.generations == shared.made[-1].generations == 2  # the producer's count, after its last batch
    assert pipeline.state_dict()["generations"] == 2 and state.generations == 0  # the loop counts nothing
    time.sleep(0.3)
    assert len(shared.made) == 2  # nothing more until new weights are published
    batches = [_step(pipeline, state, learner) for _ in range(4)]
    assert [b.index for b in batches] == [0, 1, 2, 3]
    assert state.generations == 4  # the count after the batch taken, written by next()
    with pytest.raises(RuntimeError, match="made every batch this run needs"):
        pipeline.next(state)
    assert shared.phase is Phase.DONE and not shared.made
    # reward functions saw the loop's state published with their batch's weights
    assert [(s.global_step, s.max_steps, s.entropy_coef, s.generations) for s in collector.states] == [
        (0, 4, 0.5, 0), (0, 4, 0.5, 1), (1, 4, 0.5, 2), (2, 4, 0.5, 3)]
    assert [s.epoch for s in collector.states] == [0.0, 0.0, 0.25, 0.5]
    pipeline.close()
    assert shared.phase is Phase.STOPPED and pipeline.thread is None and not shared.snapshots


def test_quiesce_waits_for_the_batch_being_made_and_lifts_the_room_limit():
    pipeline, collector, learner = _ahead(staleness=2, queue=4)  # room for one batch of 4 rows
    collector.gate.clear()  # the producer blocks inside collect: WORKING
    state = TrainerState(max_steps=6)
    pipeline.start(state, total_micro_batches=6)
    deadline = time.monotonic() + 10
    while pipeline.shared.phase is not Phase.WORKING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pipeline.shared.phase is Phase.WORKING
    threading.Timer(0.3, collector.gate.set).start()
    pipeline.quiesce()
    # k = 2: batches 0-2 come from step 0's weights; the queue limit held the producer at one, quiesce lifted it
    assert pipeline.shared.phase is Phase.WAITING and [m.index for m in pipeline.shared.made] == [0, 1, 2]
    pipeline.close()


def test_a_failure_in_the_producer_is_raised_where_its_batch_is_needed():
    pipeline, collector, learner = _ahead(staleness=1, fail_at=1)
    state = TrainerState(max_steps=4)
    pipeline.start(state, total_micro_batches=4)
    pipeline.quiesce()  # a failed producer is not waited for
    assert pipeline.shared.phase is Phase.FAILED
    assert _step(pipeline, state, learner).index == 0  # the batch made before the failure is trained on first
    with pytest.raises(ValueError, match="batch 1 failed on purpose"):
        pipeline.next(state)
    pipeline.close()
    assert pipeline.shared.phase is Phase.STOPPED


def test_publish_adds_a_snapshot_and_a_state_copy_and_changes_nothing_else():
    pipeline, collector, learner = _ahead(staleness=1)
    state = TrainerState(max_steps=4)
    pipeline.start(state, total_micro_batches=4)
    pipeline.quiesce()
    assert not pipeline.shared.snapshots  # step 0's dropped once batches 0 and 1, all it makes, were made
    before = (list(pipeline.shared.made), pipeline.shared.next_index, pipeline.shared.generations)
    state.global_step, state.log_history = 1, [{"loss": 1.0}]
    with pipeline.cond:  # the producer would make batch 2 at once otherwise
        pipeline.publish(state)
        assert set(pipeline.shared.snapshots) == {1}
        assert (list(pipeline.shared.made), pipeline.shared.next_index, pipeline.shared.generations) == before
        published = pipeline.shared.snapshots[1].state
    state.log_history.append({"loss": 2.0})
    assert published is not state and published.global_step == 1 and published.log_history == [{"loss": 1.0}]
    pipeline.close()


# ---------------------------------------------------------------------- ShadowPolicy.load
class Tied(torch.nn.Module):
    """An embedding, a body and an output layer tied to the embedding (as tie_word_embeddings does)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(6, 4)
        self.body = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight


def _moved(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_shadow_loads_a_snapshot_whole_tied_weights_included(frozen):
    learner = Tied()
    if frozen:  # as PEFT's base: the snapshot holds the trainable tensors only (the tied head's second name not)
        learner.body.requires_grad_(False)
    shadow = ShadowPolicy(shadow_copy(learner), 0)
    _moved(learner)
    snapshot = take_snapshot(learner, 1, 1)
    assert ("head.weight" in snapshot.omitted) == frozen and ("body.weight" in snapshot.tensors) != frozen
    shadow.load(snapshot)
    assert shadow.version == 1
    for name, tensor in learner.state_dict().items():
        assert torch.equal(shadow.model.state_dict()[name], tensor), name
    assert shadow.model.head.weight is shadow.model.embed.weight


def test_the_shadow_refuses_a_snapshot_it_cannot_load_whole():
    learner = Tied()
    shadow = ShadowPolicy(shadow_copy(learner), 0)
    snapshot = take_snapshot(learner, 2, 1)
    renamed = {f"module.{name}": tensor for name, tensor in snapshot.tensors.items()}  # a wrapper's names
    with pytest.raises(RuntimeError, match=r"weights of step 2 \(version 1\): the shadow has no tensor named "
                                           r"module\.embed\.weight.*; the snapshot lacks embed\.weight"):
        shadow.load(dataclasses.replace(snapshot, tensors=renamed))
    added = {**snapshot.tensors, "adapter.weight": torch.zeros(2)}
    with pytest.raises(RuntimeError, match="the shadow has no tensor named adapter.weight"):
        shadow.load(dataclasses.replace(snapshot, tensors=added))
    partial = {name: t for name, t in snapshot.tensors.items() if name != "body.bias"}
    with pytest.raises(RuntimeError, match=r"the snapshot lacks body\.bias\. "):
        shadow.load(dataclasses.replace(snapshot, tensors=partial))
    shadow.load(dataclasses.replace(snapshot, tensors=partial, omitted=frozenset({"body.bias"})))  # left out: fine
    assert shadow.version == 1
    shadow.load(Snapshot(3, 1, {"nothing": torch.zeros(1)}))  # the version it holds: not loaded again


# ---------------------------------------------------------------------- SnapshotPolicy (no model copy)
def test_an_engine_with_its_own_weights_is_streamed_the_snapshot_without_a_model_copy():
    from grpokit.train.shadow import SnapshotPolicy, streams_snapshots

    learner = Tied()
    assert streams_snapshots(learner, "vllm") and not streams_snapshots(learner, "local")
    policy = SnapshotPolicy(learner.state_dict(), 0)
    assert not hasattr(policy, "model")
    _moved(learner)
    policy.load(take_snapshot(learner, 1, 1))
    streamed = dict(policy.weights())
    assert policy.version == 1 and not policy.weights().collective
    assert list(streamed) == list(learner.state_dict())  # every name, the tied head's too
    for name, tensor in learner.state_dict().items():
        assert torch.equal(streamed[name], tensor), name
    learner.body.requires_grad_(False)  # frozen: snapshots would lack tensors, a shadow model is kept instead
    assert not streams_snapshots(learner, "vllm")


def test_the_snapshot_policy_refuses_a_snapshot_with_other_names():
    from grpokit.train.shadow import SnapshotPolicy

    learner = Tied()
    policy = SnapshotPolicy(learner.state_dict(), 0)
    snapshot = take_snapshot(learner, 2, 1)
    renamed = {f"module.{name}": tensor for name, tensor in snapshot.tensors.items()}
    with pytest.raises(RuntimeError, match=r"the shadow has no tensor named .*module\.embed\.weight"):
        policy.load(dataclasses.replace(snapshot, tensors=renamed))
    with pytest.raises(RuntimeError, match="before loading a snapshot"):
        policy.weights()


def test_the_snapshot_policy_refuses_a_snapshot_with_tensors_left_out():
    """A parameter frozen after the run started: the engine would be pushed part of the model."""
    from grpokit.train.shadow import SnapshotPolicy

    learner = Tied()
    policy = SnapshotPolicy(learner.state_dict(), 0)
    learner.body.requires_grad_(False)
    with pytest.raises(RuntimeError, match="leave out 3 frozen tensors"):
        policy.load(take_snapshot(learner, 3, 1))

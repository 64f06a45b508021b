"""The asynchronous producer's copy of the policy (asynchronous.py): the snapshots the loop publishes at sync points
and the shadow model the producer loads them into.

    shadow = ShadowPolicy(shadow_copy(learner.unwrapped), learner.version)   # once, at the pipeline's making; or,
    shadow = SnapshotPolicy(learner.unwrapped.state_dict(), learner.version)  # streams_snapshots: no model copy
    snapshot = take_snapshot(learner.unwrapped, step, version, state)         # the loop, at a sync point
    shadow.load(snapshot)                                                     # the producer, between its batches

A snapshot holds the tensors an optimizer step can change, on the CPU: every state-dict tensor, or with frozen
parameters (a PEFT model) the trainable ones only, the rest named in `omitted`. Loading checks that every tensor
lands and that the shadow lacks nothing but what was omitted: a renamed or added tensor raises, where the shadow
would otherwise go on generating with weights that never move. A tied weight (lm_head.weight tied to the
embedding) is the same tensor in the shadow (a deep copy keeps ties), loaded through whichever name it came by.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch

from grpokit.train.batches import TrainerState
from grpokit.train.weights import TensorStream, named_weights


class ShadowPolicy:
    """The producer's policy for the collector: `version`, `weights()` (the shadow's weight stream), `generating()`
    and `lockstep()` (never: the shadow is a whole model in this process)."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self.model, self.version = model, version

    def weights(self):
        return named_weights(self.model)

    def generating(self):
        return contextlib.nullcontext()

    def lockstep(self) -> bool:
        return False

    def load(self, snapshot: "Snapshot") -> None:
        """Load the snapshot's tensors into the shadow (unless it holds that version already); every tensor must
        land, and every one the snapshot left out must be one it was meant to leave out (frozen: PEFT's base)."""
        if snapshot.version != self.version:
            loaded = self.model.load_state_dict(snapshot.tensors, strict=False)
            check_loaded(snapshot, loaded.missing_keys, loaded.unexpected_keys)
            self.version = snapshot.version


class SnapshotPolicy:
    """The producer's policy where its engine keeps weights of its own (vLLM, an engine of the user's): no copy of
    the model; the loaded snapshot's tensors are what `weights()` streams to the engine. Only where every
    parameter trains, so that a snapshot holds every tensor: not for a PEFT model (its snapshot holds the adapters,
    and merging them needs the model) nor one with frozen parameters (a ShadowPolicy there), nor for the local
    engine (it decodes with a model). `streams_snapshots(model, engine)` says which."""

    def __init__(self, names, version: int) -> None:
        self.names, self.version, self.snapshot = frozenset(names), version, None

    def weights(self) -> TensorStream:
        if self.snapshot is None:
            raise RuntimeError("Asynchronous rollouts: the producer pushed weights before loading a snapshot.")
        return TensorStream(self.snapshot.tensors)

    def generating(self):
        return contextlib.nullcontext()

    def lockstep(self) -> bool:
        return False

    def load(self, snapshot: "Snapshot") -> None:
        """Keep the snapshot, once its names are the policy's: every one there (less those left out on purpose)
        and no other."""
        if snapshot.omitted:  # a parameter frozen since the run started: the engine would miss its tensors
            raise RuntimeError(
                f"Asynchronous rollouts: the weights of step {snapshot.step} leave out {len(snapshot.omitted)} frozen "
                "tensors, but the engine is pushed whole snapshots (every parameter trained when the run started). "
                "Freeze parameters before the trainer is built, not during training.")
        given = set(snapshot.tensors)
        check_loaded(snapshot, sorted(self.names - given), sorted(given - self.names))
        self.snapshot, self.version = snapshot, snapshot.version


def streams_snapshots(model: torch.nn.Module, engine: str) -> bool:
    """Whether the producer can push its snapshots' tensors as they are (SnapshotPolicy): an engine other than the
    local one, and every parameter of the (unwrapped) policy trains, so that a snapshot holds every tensor."""
    return engine != "local" and all(p.requires_grad for p in model.parameters())


def check_loaded(snapshot: "Snapshot", missing: list[str], unexpected: list[str]) -> None:
    """Raise when the shadow did not take a snapshot whole: names it has no tensor for (`unexpected`), or tensors
    of its own the snapshot should have held (`missing`, less those take_snapshot left out on purpose)."""
    missing = [name for name in missing if name not in snapshot.omitted]
    if not missing and not unexpected:
        return
    named = lambda names: ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")  # noqa: E731
    problems = ([f"the shadow has no tensor named {named(unexpected)}"] if unexpected else []) + \
               ([f"the snapshot lacks {named(missing)}"] if missing else [])
    raise RuntimeError(f"Asynchronous rollouts: the producer's copy of the policy cannot load the weights of step "
                       f"{snapshot.step} (version {snapshot.version}): {'; '.join(problems)}. The policy's tensors "
                       "were renamed or added after the copy was made (a wrapper, a new adapter): the producer would "
                       "generate with weights that no longer move.")


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a sync point publishes, on the CPU: `step` (optimizer steps done), the learner's `version`, the tensors
    by state-dict name (a PEFT model: the trainable ones only), the state-dict names left out (`omitted`: frozen),
    and a copy of the loop's TrainerState then (`state`, what reward functions read; None outside a pipeline)."""

    step: int
    version: int
    tensors: dict[str, torch.Tensor]
    omitted: frozenset[str] = frozenset()
    state: TrainerState | None = None


def shadow_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of the unwrapped policy in eval mode, for generation only."""
    shadow = copy.deepcopy(model)
    shadow.requires_grad_(False)
    return shadow.eval()


def take_snapshot(model: torch.nn.Module, step: int, version: int, state: TrainerState | None = None) -> Snapshot:
    """The tensors an optimizer step can change, copied to the CPU (all of them unless some are frozen; a frozen
    one, or one tied to a trainable one and named second, is `omitted`), and a copy of `state`."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = any(not p.requires_grad for p in model.parameters())
    tensors, omitted = {}, set()
    for name, tensor in model.state_dict().items():
        if not frozen or name in trainable:
            tensors[name] = tensor.detach().to("cpu", copy=True)
        else:
            omitted.add(name)
    if state is not None:  # log_history grows in place: the rows so far
        state = dataclasses.replace(state, log_history=list(state.log_history))
    return Snapshot(step, version, tensors, frozenset(omitted), state)

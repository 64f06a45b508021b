"""The policy's weights as a stream of whole tensors: what a rollout engine is given, and what an export writes
(rollout/weights_file.py writes a stream into a model folder).

    stream = named_weights(model)          # a fresh stream per push: iterating it may be a collective
    stream.specs()                         # [(name, shape, dtype)] without gathering anything
    for name, tensor in stream: ...        # every weight, whole and detached, in state-dict order

One rule for every consumer:
- names are the Hugging Face names of the base model, with a PEFT model's adapters merged in: for plain LoRA
  linear layers each merged weight is computed beside its base weight (base + delta, adapter by adapter, as
  LoRA's merge adds them), which is never touched; other adapter kinds are merged in place by PEFT while the
  stream is read and unmerged after, also when the consumer stops early (that round trip is not bit-exact: the
  base weights drift by rounding with every push). The adapters' own tensors are not in the stream;
- a tied weight is one tensor under each of its names (a sharded one is gathered once): vLLM keeps its own copy of
  a tied head, and save_pretrained recognises the shared tensor;
- under FSDP2 (DTensor shards) each weight is gathered whole (`full_tensor()`) when it is reached: every process
  must read the stream to the end, in step (`collective`); at most one gathered weight (and a tied weight until
  its last name) is held here. Merging a PEFT adapter into a sharded base is not supported: such a stream raises
  when read (vLLM with a sharded PEFT policy is refused before the model loads; the local engine never reads it).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import torch
from torch.distributed.tensor import DTensor

from grpokit.errors import ConfigError


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")


# What a PEFT wrapper leaves in a name once unwrapped: a key still holding one of these was not mapped (a PEFT
# feature the stream does not know), and is refused rather than pushed under a name no engine loads.
PEFT_MARKERS = (".base_layer.", ".modules_to_save.", ".original_module.", ".token_adapter.", "trainable_tokens")


def _peft_names(model) -> tuple[dict[str, str], tuple[str, ...]]:
    """For a PEFT model's base: {wrapped prefix: plain prefix} (a tuner layer's base layer; the active adapter's
    copy of a module to save) and the prefixes whose tensors are the adapters' own (every tuner's adapter
    tensors and parameters, the original of a module to save, the other adapters' copies)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import ModulesToSaveWrapper

    renames, dropped = {}, []
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, BaseTunerLayer):
            renames[f"{name}.base_layer."] = f"{name}."
            names = (*module.adapter_layer_names, *module.other_param_names)
            dropped += [f"{name}.{attr}." for attr in names]
        elif isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters
            if len(active) != 1:
                raise ConfigError(f"The module {name} is saved for {len(active)} active adapters at once; stream "
                                  "the weights with one adapter active (model.set_adapter(name)).")
            renames[f"{name}.modules_to_save.{active[0]}."] = f"{name}."
            dropped.append(f"{name}.original_module.")
            dropped += [f"{name}.modules_to_save.{other}." for other in module.modules_to_save if other != active[0]]
    return renames, tuple(dropped)


def _base_name(name: str, renames: dict[str, str], dropped: tuple[str, ...]) -> str | None:
    """A PEFT base model's state-dict key under the plain model's name; None for the adapters' own tensors."""
    if name.startswith(dropped):
        return None
    for wrapped, plain in renames.items():
        if name.startswith(wrapped):
            name = plain + name[len(wrapped):]
            break
    if any(marker in name for marker in PEFT_MARKERS):
        raise ConfigError(f"The PEFT model's tensor {name!r} has no plain model name the weight stream knows (a PEFT "
                          "feature such as trainable_token_indices): merge the adapter yourself "
                          "(model.merge_and_unload()) before training, or leave that option out.")
    return name


def _plain_lora_merges(model) -> dict[str, tuple[torch.nn.Module, list[str]]] | None:
    """base-layer weight key -> (LoRA linear layer, its active adapters) for every adapter layer of a PEFT model,
    when all are plain LoRA linear layers (no DoRA or other variant, no LoRA bias, not merged): their merged
    weights are computed beside the base weights, which stay untouched. None where some layer is of another kind."""
    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.tuners_utils import BaseTunerLayer

    merges = {}
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if type(module) is not LoraLinear or module.merged:  # another tuner (IA3, LoHa, a LoRA embedding, ...)
            return None
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if any(a in getattr(module, "lora_variant", {}) or module.use_dora.get(a, False)  # DoRA before peft 0.15
               or module.lora_bias.get(a, False) for a in adapters):
            return None
        if not adapters:
            continue
        merges[f"{name}.base_layer.weight"] = (module, adapters)
    return merges


class WeightStream:
    """(name, tensor) pairs of every weight of `model` (the unwrapped policy), by the module's rules. merge
    (a PEFT model): the base weights with the adapters merged in; False: the adapters' own tensors only, under
    PEFT's names (`get_peft_model_state_dict`: what an engine that loads LoRA adapters takes)."""

    def __init__(self, model: torch.nn.Module, merge: bool = True) -> None:
        self.model, self.merge = model, merge

    @property
    def collective(self) -> bool:
        """Reading the stream gathers shards: every process reads it to the end, in step."""
        return any(isinstance(p, DTensor) for p in self.model.parameters())

    def _entries(self) -> dict[str, torch.Tensor]:
        if not _is_peft(self.model):
            return self.model.state_dict(keep_vars=True)  # the parameters themselves: a tied one is one object
        if not self.merge:
            from peft import get_peft_model_state_dict

            return get_peft_model_state_dict(self.model)
        renames, dropped = _peft_names(self.model)
        named = ((_base_name(k, renames, dropped), v) for k, v in self.model.get_base_model().state_dict().items())
        return {name: tensor for name, tensor in named if name is not None}

    def specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """Every name with its whole shape and dtype, nothing gathered."""
        return [(name, tensor.shape, tensor.dtype) for name, tensor in self._entries().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if _is_peft(self.model) and self.merge:
            if self.collective:
                raise ConfigError("Merging a PEFT adapter into a sharded (FSDP) base is not supported: stream "
                                          "the adapter alone (named_weights(model, merge=False)), or train without "
                                          "FSDP to export merged weights.")
            return self._merged()
        return self._whole(self._entries())

    def _merged(self) -> Iterator[tuple[str, torch.Tensor]]:
        merges = _plain_lora_merges(self.model)
        if merges is None:  # an adapter kind only PEFT knows how to merge: merged in place, unmerged after
            yield from self._merged_in_place()
            return
        renames, dropped = _peft_names(self.model)
        with torch.no_grad():
            for name, tensor in self.model.get_base_model().state_dict(keep_vars=True).items():
                base = _base_name(name, renames, dropped)
                if base is None:
                    continue
                if name in merges:
                    module, adapters = merges[name]
                    merged = tensor.detach().clone()
                    for adapter in adapters:  # as LoRA's merge: weight += delta, adapter by adapter
                        merged += module.get_delta_weight(adapter)
                    yield base, merged
                else:
                    yield base, tensor.detach()

    def _merged_in_place(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.model.merge_adapter()
        try:
            for name, tensor in self._entries().items():
                yield name, tensor.detach().clone()  # unmerged after the stream: the consumer keeps a copy
        finally:
            self.model.unmerge_adapter()

    @staticmethod
    def _whole(entries: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        left = collections.Counter(id(tensor) for tensor in entries.values())  # names still to come, per tensor
        gathered: dict[int, torch.Tensor] = {}
        for name, tensor in entries.items():
            key = id(tensor)
            whole = gathered.get(key)
            if whole is None:
                with torch.no_grad():
                    whole = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
            left[key] -= 1
            if left[key]:
                gathered[key] = whole  # a tied weight: its other names come later
            else:
                gathered.pop(key, None)
            yield name, whole


class TensorStream:
    """A stream over tensors that are whole already (an asynchronous snapshot, on the CPU), under their names: the
    same protocol as WeightStream, never collective."""

    collective = False

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def specs(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(name, tensor.shape, tensor.dtype) for name, tensor in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())


def named_weights(model: torch.nn.Module, merge: bool = True) -> WeightStream:
    """The stream of `model`'s weights (the unwrapped policy: plain, PEFT or FSDP2-sharded); `merge`: a PEFT
    model's adapters merged into the base weights (True), or the adapters' tensors alone (False)."""
    return WeightStream(model, merge)

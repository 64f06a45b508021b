"""FSDP2 for the learner: the policy and the reference sharded with `fully_shard`, and what a sharded model needs.

    options = run_options(args, processes)             # FSDPOptions, or None: DDP as before
    shard(model, options, device, bf16)                # every decoder layer a unit, then the root
    norm = clip_gradients(model.parameters(), 1.0)     # the global norm over every shard (a plain tensor)
    with gathered_for_generation(model, True): ...     # decode with the whole model gathered once
    is_gathered(model)                                 # inside that block: forwards make no collective
    with held_for_step(model, True): ...               # a step's micro-batches: the root gathered once
    with held_for_passes(model, True, True): ...       # a no-grad pass's chunks: the whole model gathered once
    state = full_state_dict(model)                     # collective: the whole model on process 0 ({} elsewhere)
    load_full_state(model, state)                      # collective: process 0's whole state dict into the shards

Sharding: each module whose class is in the model's `_no_split_modules` (its decoder layers; or fsdp_config's
transformer_layer_cls_to_wrap) becomes one FSDP unit, and the root takes the rest (embeddings, final norm, output
head). Parameters are DTensors holding 1/world of each matrix along dim 0; a layer unit's forward all-gathers its
full weights and frees them after (reshard_after_forward), its backward gathers them again and reduce-scatters the
gradients (averaged, as DDP averages). With bf16=True parameters are gathered and used in bf16 and gradients reduced
in fp32 (MixedPrecisionPolicy); the shards, the gradients and AdamW's moments stay fp32.

Step time (docs/distributed.md, "Step time"): the root, the largest unit at a real vocabulary, is never resharded
after its forward (the backward needs it at once; FSDP2's own default for the root): `held_for_step` keeps it
gathered across a step's micro-batches (every unit with shard_grad_op) and frees it after; a no-grad pass has no
backward, so `reshard` (or `held_for_passes`, around a pass's chunks) frees it. On gloo the all-gather runs as one
broadcast per process and the reduce-scatter as an all-reduce: gloo's own allgather and reduce_scatter move the
same bytes 2-3x slower on one machine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.fsdp import FSDPOptions, fsdp_options

logger = logging.getLogger("grpokit")
_GATHERED = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on process 0's CPU only


def run_options(args: GRPOConfig, processes: int, agentic: bool, peft: bool = False) -> FSDPOptions | None:
    """The run's FSDP2 options (from fsdp / fsdp_config or accelerate's environment), None for DDP; checked before
    the model loads, with what sharded runs cannot do (`agentic`: tools or environments; `peft`: an adapter is
    trained). One process has nothing to shard across: it runs unsharded, with a warning."""
    options = fsdp_options(args.fsdp, args.fsdp_config, os.environ)
    engine = args.resolved_rollout_engine
    if options is not None and engine not in ("local", "vllm"):
        raise ConfigError(f"FSDP with rollout_engine={engine!r}: an engine of your own would read the policy's "
                          "weights as shards (DTensors); under FSDP use rollout_engine='local' or 'vllm'.")
    if options is not None and engine == "vllm" and peft:
        raise ConfigError("FSDP with vLLM and a PEFT adapter: merging the adapter into sharded base weights for the "
                          "push is not supported; train the adapter with DDP (no fsdp), or use rollout_engine='local' "
                          "(it decodes through the shards).")
    if options is not None and agentic and engine == "local" and not args.ds3_gather_for_generation:
        raise ConfigError("FSDP with tools or environments needs ds3_gather_for_generation=True (the default): "
                          "multi-turn episodes make a different number of generation calls on each process, and with "
                          "it False every forward gathers one layer collectively, so every process would have to make "
                          "the same calls. Set ds3_gather_for_generation: true (the whole policy is then gathered "
                          "once for all the turns of a batch), or use use_vllm.")
    if options is not None and processes == 1:
        logger.warning("FSDP was asked for, but this run has one process: the model is not sharded. Launch several "
                       "processes (accelerate launch --num_processes N, or torchrun --nproc_per_node N).")
        return None
    return options


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def layer_units(model: torch.nn.Module, wrap_classes: tuple[str, ...]) -> list[torch.nn.Module]:
    """The modules that become one FSDP unit each: instances of `wrap_classes`, else of the model's own
    `_no_split_modules` (its decoder layers), outermost first."""
    names = set(wrap_classes) or {name for m in model.modules() for name in getattr(m, "_no_split_modules", None) or ()}
    units = [m for m in model.modules() if type(m).__name__ in names]
    if not units:
        raise ConfigError(f"FSDP: no module of class {sorted(names) or '(none named)'} in {type(model).__name__}; "
                          "name the decoder layer class with fsdp_config transformer_layer_cls_to_wrap.")
    return units


def shard(model: torch.nn.Module, options: FSDPOptions, device: torch.device, bf16: bool) -> torch.nn.Module:
    """`model` sharded in place over every process (a 1-D mesh): each layer unit, then the root; with
    cpu_ram_efficient_loading, process 0's weights then fill every shard (the others may hold zeros). Returns it."""
    broadcast = options.cpu_ram_efficient_loading
    weights = model.state_dict() if broadcast and torch.distributed.get_rank() == 0 else {}
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy() if options.offload_params and device.type != "cpu" else OffloadPolicy()
    # The log-prob passes and the decode loop never write into a model's output in place, which is what this
    # warning (once per forward returning a slice of the hidden states) is about.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for unit in layer_units(model, options.wrap_classes):
        fully_shard(unit, mesh=mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mixed,
                    offload_policy=offload)
    # The root (embeddings, final norm, output head: the largest unit at a real vocabulary) stays gathered from its
    # forward until the backward, which needs it at once (FSDP2's own default for the root): a micro-batch's shared
    # prompt pass, completion pass and head pass then gather it once, not three times.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mixed, offload_policy=offload)
    if device.type == "cpu" and "gloo" in str(torch.distributed.get_backend(mesh.get_group())):
        from grpokit.train.gloo_collectives import use_faster_gloo_collectives  # a private torch API: CPU only

        use_faster_gloo_collectives(units(model))
    if broadcast:
        load_full_state(model, weights)
    return model


def units(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP units of `model`, outermost (the root) first."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_for_generation(model: torch.nn.Module, reshard_after_forward: bool):
    """Inside the block every unit of a sharded `model` is gathered once (a collective per unit) and stays gathered
    through every forward, so decoding makes no collective per token; after it, every unit is freed and resharding
    after forward is back to `reshard_after_forward`. Nothing for a model that is not sharded, or already inside
    this block (the outer one frees the weights)."""
    if is_gathered(model):
        yield
        return
    every = units(model)
    for unit in every:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    model._grpokit_gathered = True  # is_gathered: forwards make no collective, no lockstep needed
    try:
        yield
    finally:
        model._grpokit_gathered = False
        for unit in every:
            unit.set_reshard_after_forward(reshard_after_forward and unit is not model, recurse=False)
            unit.reshard()


def is_gathered(model: torch.nn.Module) -> bool:
    """Whether `model` is inside gathered_for_generation: every unit holds its full weights, so its forwards make
    no collective (processes need not decode in lockstep, nor make the same number of calls)."""
    return bool(getattr(model, "_grpokit_gathered", False))


@contextlib.contextmanager
def lockstep_decoding(model: torch.nn.Module):
    """Around generation calls that decode a sharded `model` in lockstep (not gathered: every forward gathers each
    layer): after the block the root is freed too, which stays gathered after a forward for a backward that never
    comes. Nothing inside gathered_for_generation."""
    try:
        yield
    finally:
        reshard(model)


@contextlib.contextmanager
def held_for_passes(model: torch.nn.Module, whole: bool, reshard_after_forward: bool):
    """Around several no-grad passes of a sharded `model` (the chunks of a log-prob pass): `whole`, every unit is
    gathered once for the block (as for generation); else each layer is gathered per forward as usual, and the root,
    kept gathered after its first forward, serves every pass. Every unit is freed after the block. Nothing for a
    model that is not sharded, or inside gathered_for_generation (already whole: the nested block and reshard do
    nothing there)."""
    if not is_sharded(model):
        yield
        return
    try:
        if whole:
            with gathered_for_generation(model, reshard_after_forward):
                yield
        else:
            yield
    finally:
        reshard(model)


@contextlib.contextmanager
def held_for_step(model: torch.nn.Module, reshard_after_forward: bool):
    """Around the micro-batches of one optimizer step of a sharded `model`: the root (never resharded between its
    forward and its backward) also stays gathered from one micro-batch to the next, so it is gathered once per
    step; with reshard_after_forward False (shard_grad_op) every unit does, gathered once per step rather than once
    per forward and again in the backward. Gradients are still reduce-scattered every micro-batch, so nothing
    unsharded outlives the step: every unit is freed after it."""
    held = units(model) if not reshard_after_forward else [model]
    for unit in held:
        unit.set_reshard_after_backward(False, recurse=False)
    try:
        yield
    finally:
        for unit in held:
            unit.set_reshard_after_backward(True, recurse=False)
        reshard(model)


def reshard(model: torch.nn.Module) -> None:
    """Free every gathered weight of a sharded model (after a pass without backward); nothing for others, nor
    inside gathered_for_generation (the block keeps the weights whole and frees them at its end)."""
    if is_gathered(model):
        return
    for unit in units(model):
        unit.reshard()


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Clip to `max_norm` by the global gradient norm over every process's shards; the norm (a plain tensor, the
    same on every process; inf max_norm only measures it)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective (every process calls it): the model's whole state dict, on the CPU of process 0; {} elsewhere.
    A tied weight is one tensor under each of its names, the rule of the weight stream (grpokit/train/weights.py):
    save_pretrained recognises the shared tensor and writes it once, as it does for a live tied model."""
    first: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    for name, parameter in named:
        first.setdefault(id(parameter), name)
    state = get_model_state_dict(model, options=_GATHERED)
    for name, parameter in named:
        original = first[id(parameter)]
        if original != name and original in state:
            state[name] = state[original]
    return state


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Collective: a whole state dict held by process 0 ({} elsewhere) into the shards of every process. Tied
    weights may be given once (the other name is the same parameter)."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                 strict=False))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Collective: a whole optimizer state keyed by parameter name (distcp.named_optimizer_state), held by process
    0 ({} elsewhere), into every process's shards."""
    set_optimizer_state_dict(model, optimizer, state,
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

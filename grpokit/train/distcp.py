"""Sharded checkpoints: torch.distributed.checkpoint (DCP) folders into which each process writes its own shards,
read back at any number of processes, and consolidated into a Hugging Face folder.

    save_sharded(folder, model, optimizer, reference, adapter_only)   # collective: folder/sharded/
    load_sharded(folder, model, optimizer, reference, adapter_only)   # collective: re-sharded to this run
    export_checkpoint(checkpoint, out)                                # one process: a from_pretrained folder

`folder/sharded/` holds `__<rank>_0.distcp` (process `rank`'s shards of every tensor: the policy's weights, AdamW's
moments, the synced reference's weights) and `.metadata` (process 0: where each piece of each tensor lies), under
the keys `model.<name>`, `optimizer.state.<name>.<exp_avg|exp_avg_sq|step>`, `optimizer.param_groups...` and
`reference.<name>`, names being the model's own (a DTensor's global name). Reading gives each process the pieces
its own shards need, whatever the number of processes that wrote them: a checkpoint of 2 processes resumes at 1,
2 or 4, and a model that is not sharded (one process, or DDP) reads the whole tensors. With a PEFT adapter only
the trainable tensors are saved (the frozen base is the one the run loads).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

logger = logging.getLogger("grpokit")
SHARDED_DIR = "sharded"  # the DCP folder inside checkpoint-<step>


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it runs in one process when no process group exists: the intended case here (one process,
    or an export)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _options(adapter_only: bool) -> StateDictOptions:
    return StateDictOptions(ignore_frozen_params=adapter_only, strict=not adapter_only)


def _plain(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's AcceleratedOptimizer (DCP reads param_groups and state directly)."""
    return getattr(optimizer, "optimizer", optimizer)


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, reference: torch.nn.Module | None,
                  adapter_only: bool) -> dict:
    """This process's view of the checkpointed tensors ({"model", "optimizer"[, "reference"]}): its shards under
    FSDP, whole tensors otherwise; what DCP writes from and reads into."""
    options = _options(adapter_only)
    state = {"model": get_model_state_dict(model, options=options),
             "optimizer": get_optimizer_state_dict(model, _plain(optimizer), options=options)}
    if reference is not None:
        state["reference"] = get_model_state_dict(reference)
    return state


def save_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 reference: torch.nn.Module | None, adapter_only: bool) -> None:
    """Collective: folder/sharded/ with every process's shards of the model, the optimizer state and (when given)
    the reference model. `folder` must be one every process can write (a shared filesystem across machines)."""
    with _quiet_single_process():
        dcp.save(sharded_state(model, optimizer, reference, adapter_only), checkpoint_id=folder / SHARDED_DIR)


def load_sharded(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 reference: torch.nn.Module | None, adapter_only: bool) -> None:
    """Collective: folder/sharded/ into this process's shards (re-sharded when another number of processes wrote
    it; whole tensors for a model that is not sharded). `reference` only when the checkpoint holds one."""
    state = sharded_state(model, optimizer, reference, adapter_only)
    check_matches(folder, state["model"], adapter_only)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=folder / SHARDED_DIR)
    options = _options(adapter_only)
    set_model_state_dict(model, state["model"], options=options)
    set_optimizer_state_dict(model, _plain(optimizer), state["optimizer"], options=options)
    if reference is not None:
        set_model_state_dict(reference, state["reference"])


def check_matches(folder: Path, model_state: dict, adapter_only: bool) -> None:
    """CheckpointError, before anything is read, when the checkpoint's model tensors (names and global shapes, from
    its .metadata) are not this run's: another model, or a PEFT adapter where the run has none or the reverse."""
    from grpokit.errors import CheckpointError

    saved = {key.removeprefix("model."): meta.size for key, meta in saved_tensors(folder).items()
             if key.startswith("model.") and hasattr(meta, "size")}
    saved_adapter = any("lora_" in name for name in saved)
    if saved_adapter != adapter_only:
        raise CheckpointError(
            f"{folder} holds a PEFT adapter's weights and this run trains the whole model: resume it with the same "
            "peft_config (its adapter_config.json)." if saved_adapter else
            f"{folder} holds a whole model's weights and this run trains a PEFT adapter: resume it without "
            "peft_config, or start a new run.")
    missing = [name for name in model_state if name not in saved]
    changed = [(name, tuple(saved[name]), tuple(tensor.shape)) for name, tensor in model_state.items()
               if name in saved and tuple(saved[name]) != tuple(tensor.shape)]
    if missing or changed:
        detail = (f"{changed[0][0]} is {list(changed[0][1])} in the checkpoint and {list(changed[0][2])} in this "
                  f"run's model" if changed else f"{len(missing)} of this run's tensors are not in it, e.g. {missing[0]}")
        raise CheckpointError(f"{folder} was trained from another model: {detail}. Resume it with the model (and "
                              "model_init_kwargs) it was trained from.")


def is_sharded_checkpoint(folder: Path) -> bool:
    """Whether a checkpoint's weights are in SHARDED_DIR (a missing .metadata in it is named when it is read)."""
    return (folder / SHARDED_DIR).is_dir()


def saved_tensors(folder: Path) -> dict:
    """A sharded checkpoint's stored entries by flattened key (`model.<name>`, `optimizer.state.<name>.exp_avg`,
    ...), each with its global size, from its .metadata; a CheckpointError when that cannot be read."""
    from grpokit.errors import CheckpointError

    try:
        return dcp.FileSystemReader(str(folder / SHARDED_DIR)).read_metadata().state_dict_metadata
    except Exception as exc:  # noqa: BLE001 - a missing or damaged .metadata, named
        raise CheckpointError(f"{folder / SHARDED_DIR / '.metadata'} cannot be read ({type(exc).__name__}); copy "
                              "the checkpoint again from where it was written.") from exc


def saved_keys(folder: Path) -> set[str]:
    """The flattened keys stored in a sharded checkpoint (see saved_tensors)."""
    return set(saved_tensors(folder))


def named_optimizer_state(model: torch.nn.Module, state: dict) -> dict:
    """A plain optimizer state dict (parameters numbered in the order the optimizer was built from
    model.parameters() with requires_grad) keyed by parameter name instead, as set_optimizer_state_dict reads a
    whole one: how a checkpoint written without FSDP resumes sharded."""
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    numbered = [index for group in state["param_groups"] for index in group["params"]]
    if len(numbered) != len(names):
        raise ValueError(f"the saved optimizer holds {len(numbered)} parameters, the model trains {len(names)}")
    name_of = dict(zip(numbered, names))
    return {"state": {name_of[index]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


# ---------------------------------------------------------------------------- export
def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A folder `out` that from_pretrained loads, from any checkpoint: a sharded one is consolidated (each tensor
    read whole from every process's shards), a whole one (written without FSDP) copied. Written to a staging
    folder beside `out` and renamed into place; `out` must not hold files already. Returns `out`. A damaged or
    foreign checkpoint is a CheckpointError, a failed write a SaveError (the path and the free space)."""
    from grpokit.errors import writing
    from grpokit.train.checkpointer import CheckpointError, damage

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint} is not a folder: pass a checkpoint-<step> folder (or OUTPUT_DIR/best).")
    check_destination(checkpoint, out)
    if (checkpoint / "trainer_state.json").is_file() or (checkpoint / "manifest.json").is_file():
        problem = damage(checkpoint, check_name=False)  # a renamed copy of a checkpoint exports as it is
        if problem is not None:
            raise CheckpointError(f"Cannot export {checkpoint}: {problem}.")
    sharded = is_sharded_checkpoint(checkpoint)
    model = _consolidated(checkpoint) if sharded else None  # reads only: its errors are the checkpoint's
    adapter = (checkpoint / "adapter_config.json").is_file()
    sources = [checkpoint / name for name in MODEL_FILES
               if (checkpoint / name).is_file() and not (adapter and name == "config.json")]  # see MODEL_FILES
    if not sharded:
        sources += _weight_files(checkpoint)
    staging = out.parent / f".{out.name}.export-staging"
    try:
        with writing("Exporting the model", out, f"{checkpoint} is unchanged; free some space or choose another "
                                                   "folder."):
            shutil.rmtree(staging, ignore_errors=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            staging.mkdir()
            if model is not None:
                model.save_pretrained(staging)
            for path in sources:
                if not (staging / path.name).exists():  # save_pretrained's config.json stays
                    shutil.copy2(path, staging / path.name)
            if out.exists():
                out.rmdir()
            staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# An adapter folder carries no config.json: with one, from_pretrained takes the folder for a whole model and looks
# for its weights instead of loading the base that adapter_config.json names.
MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json", "chat_template.jinja",
               "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
               "tokenizer.model", "added_tokens.json")


def check_destination(checkpoint: Path, out: Path) -> None:
    """CheckpointError when `out` cannot be an export's new folder: it holds files, is a file or a link, lies
    inside the checkpoint (its manifest would no longer match), or has a file where a parent folder must be."""
    from grpokit.errors import CheckpointError

    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise CheckpointError(f"{out} already exists and is not an empty folder; choose a new folder to export to.")
    target = out.resolve()
    if target == checkpoint.resolve() or checkpoint.resolve() in target.parents:
        raise CheckpointError(f"{out} is inside the checkpoint {checkpoint}: the checkpoint would no longer match its "
                              "manifest; export to a folder outside it.")
    blocked = next((p for p in target.parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise CheckpointError(f"{out} cannot be created: {blocked} is a file, not a folder.")


def _weight_files(checkpoint: Path) -> list[Path]:
    """The weight files of a checkpoint written whole (model.safetensors or its shards and index; an adapter)."""
    from grpokit.errors import CheckpointError

    weights = sorted(checkpoint.glob("model*.safetensors")) + sorted(checkpoint.glob("adapter_model.safetensors"))
    if not weights:
        raise CheckpointError(f"{checkpoint} holds neither sharded weights ({SHARDED_DIR}/) nor model*.safetensors: "
                              "it is not a grpokit checkpoint or model folder.")
    return weights + sorted(checkpoint.glob("model.safetensors.index.json"))


def _consolidated(checkpoint: Path) -> torch.nn.Module:
    """The model of a sharded checkpoint, built from its config.json without initialising weights and filled from
    the DCP shards, each tensor read whole (an adapter checkpoint: the PEFT model, over the base it names)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # transformers 5 moved it
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights

    from grpokit.errors import CheckpointError

    if not (checkpoint / "config.json").is_file():
        raise CheckpointError(f"{checkpoint / 'config.json'} is missing: the model's architecture is needed to "
                              "consolidate its shards.")
    adapter = (checkpoint / "adapter_config.json").is_file()
    try:
        config = AutoConfig.from_pretrained(checkpoint)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint / 'config.json'} cannot be read: {exc}") from exc
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config)
    model.tie_weights()  # skipped with the initialisation: a tied head is saved once, as from_pretrained expects
    if adapter:
        from peft import PeftConfig, get_peft_model

        adapter_config = PeftConfig.from_pretrained(checkpoint)
        model.name_or_path = adapter_config.base_model_name_or_path  # the base it names, not the checkpoint
        model = get_peft_model(model, adapter_config)
    options = _options(adapter)
    state = {"model": get_model_state_dict(model, options=options)}
    check_matches(checkpoint, state["model"], adapter)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=checkpoint / SHARDED_DIR)  # one process: every tensor read whole
    except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 - DCP's reader errors, named
        raise CheckpointError(f"The shards in {checkpoint / SHARDED_DIR} cannot be read ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); copy the checkpoint again from "
                              "where it was written, or export another one.") from exc
    set_model_state_dict(model, state["model"], options=options)
    logger.info("Consolidated %s (%d tensors).", checkpoint, len(state["model"]))
    return model

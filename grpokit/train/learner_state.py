"""The learner's saving and loading: checkpoints (whole, or every process's shards under FSDP), the final and best
models, and the synced reference (TR-DPO)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_model

from grpokit.config import ConfigError
from grpokit.models.loading import load_weights, read_weights
from grpokit.train.distcp import is_sharded_checkpoint, load_sharded, named_optimizer_state, save_sharded, saved_keys
from grpokit.train.fsdp import full_state_dict, load_full_optimizer_state, load_full_state

logger = logging.getLogger("grpokit")
REFERENCE_FILE = "reference.safetensors"  # the synced reference model's weights in a checkpoint (sync_ref_model)


class LearnerState:
    """The Learner's checkpoints and exports (its models, optimizer, schedule and comm are the Learner's)."""

    @torch.no_grad()
    def sync_reference(self) -> None:
        """TR-DPO: pi_ref <- alpha * pi_theta + (1 - alpha) * pi_ref, parameter by parameter."""
        alpha = self.args.ref_model_mixup_alpha
        policy = dict(self.unwrapped.named_parameters())
        for name, ref_param in self.ref_model.named_parameters():
            ref_param.mul_(1.0 - alpha).add_(policy[name].detach().to(ref_param.dtype), alpha=alpha)

    @contextlib.contextmanager
    def gathered(self):
        """Every process enters it around write_model: under FSDP the whole model is gathered onto process 0's CPU
        for the block (a collective), and freed after; nothing otherwise."""
        self._full_state = full_state_dict(self.model) if self.fsdp is not None else None
        try:
            yield
        finally:
            self._full_state = None

    def write_model(self, folder: Path, tokenizer) -> None:
        """The model (HF format, from the gathered state under FSDP: inside `gathered`) and the tokenizer."""
        state = getattr(self, "_full_state", None)
        if self.fsdp is not None and state is None:
            raise RuntimeError("write_model of a sharded model runs inside learner.gathered(), on every process.")
        self.unwrapped.save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)

    def load_weights(self, folder: Path) -> None:
        """The weights saved in `folder` (save_pretrained's files) into the policy; every process calls it."""
        if self.fsdp is None:
            load_weights(self.unwrapped, folder)
            return
        if self.uses_peft:
            raise ConfigError("Loading saved adapter weights into a sharded PEFT model is not supported yet; resume "
                              "or load the best model without fsdp.")
        load_full_state(self.model, read_weights(folder, self.unwrapped) if self.comm.is_main else {})

    def save(self, folder: Path, tokenizer) -> None:
        """The weights, tokenizer, optimizer, schedule and a synced reference. Without FSDP process 0 writes them
        whole (HF format, optimizer.pt); under FSDP every process writes its own shards (distcp.SHARDED_DIR) and
        process 0 the model's config, the tokenizer and the schedule."""
        if self.fsdp is not None:
            reference = self.ref_model if self.args.sync_ref_model else None
            save_sharded(folder, self.model, self.optimizer, reference, adapter_only=self.uses_peft)
            if self.comm.is_main:
                self.write_model_files(folder, tokenizer)
                torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
            return
        if not self.comm.is_main:
            return
        self.write_model(folder, tokenizer)
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), folder / "scheduler.pt")
        if self.args.sync_ref_model:  # the synced reference has moved away from the starting weights
            save_model(self.ref_model, str(folder / REFERENCE_FILE))

    def write_model_files(self, folder: Path, tokenizer) -> None:
        """What a sharded checkpoint needs beside its shards to become a Hugging Face folder (grpo export): the
        model's config and generation config (an adapter's config too), and the tokenizer."""
        model = self.unwrapped
        base = model.get_base_model() if self.uses_peft else model
        base.config.save_pretrained(folder)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(folder)
        if self.uses_peft:
            model.peft_config["default"].save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    def load(self, folder: Path, saved_processes: int | None = None) -> None:
        """A checkpoint's weights, optimizer, schedule and synced reference, written sharded (any number of
        processes: re-sharded to this run's) or whole (DDP or one process: loaded whole, or into the shards)."""
        reference = self.ref_model if self.args.sync_ref_model else None
        if is_sharded_checkpoint(folder):
            if reference is not None and not any(k.startswith("reference.") for k in saved_keys(folder)):
                reference = None  # written before sync_ref_model was set: the reference starts from the model
            model = self.model if self.fsdp is not None else self.unwrapped
            load_sharded(folder, model, self.optimizer, reference, adapter_only=self.uses_peft)
            if saved_processes not in (None, self.comm.size):
                logger.warning("Re-sharded %s from %d processes to %d: each process read its part of every "
                               "weight and optimizer moment.", folder, saved_processes, self.comm.size)
        else:
            self._load_whole(folder, reference)
        self.version += 1  # the engine must be given the checkpoint's weights
        self.scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=False))

    def _load_whole(self, folder: Path, reference) -> None:
        """A checkpoint written whole (HF weights, optimizer.pt numbered by parameter, reference.safetensors)."""
        self.load_weights(folder)
        optimizer = torch.load(folder / "optimizer.pt", weights_only=False)
        if self.fsdp is None:
            self.optimizer.load_state_dict(optimizer)
        else:
            whole = named_optimizer_state(self.model, optimizer) if self.comm.is_main else {}
            load_full_optimizer_state(self.model, self.optimizer, whole)
        if reference is not None and (folder / REFERENCE_FILE).is_file():
            if self.fsdp is None:
                device = str(next(reference.parameters()).device)  # "cpu", never accelerate's "cpu:0"
                load_model(reference, str(folder / REFERENCE_FILE), device=device)
            else:
                load_full_state(reference, load_file(folder / REFERENCE_FILE) if self.comm.is_main else {})

"""transformers TrainerCallback objects in grpokit's loop (TRL's `callbacks=`).

A callback gets the same calls as under transformers' Trainer, with the trainer's GRPOConfig as `args`, its
TrainerState as `state` and a transformers TrainerControl as `control`:

    on_init_end, on_train_begin, on_epoch_begin / on_epoch_end, on_step_begin, on_step_end, on_log(logs=row),
    on_evaluate(metrics=row), on_save, on_train_end

with model, processing_class, optimizer and lr_scheduler as keyword arguments. After on_step_end the trainer acts
on what the callbacks set: control.should_evaluate -> evaluate now (needs an eval_dataset), control.should_save ->
save a checkpoint now, control.should_training_stop -> stop after this step (a finished run: the model is saved,
state.interrupted stays None). The trainer's own schedule (logging_steps, eval_steps, save_steps) does not go
through `control`, so a callback such as transformers' DefaultFlowCallback is not needed.
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import TrainerControl


class CallbackError(TypeError):
    """A callback given to the trainer cannot be used."""


class Callbacks:
    """The callbacks of one trainer and the TrainerControl they share."""

    def __init__(self, callbacks: list | None, trainer: Any) -> None:
        self.items = [cb() if isinstance(cb, type) else cb for cb in (callbacks or [])]
        for cb in self.items:
            if not any(callable(getattr(cb, name, None)) for name in EVENTS):
                raise CallbackError(
                    f"callbacks: {cb!r} has none of the callback methods ({', '.join(EVENTS)}); pass "
                    "transformers.TrainerCallback subclasses (or their instances)."
                )
        self.trainer = trainer
        self.control = TrainerControl()

    def event(self, name: str, **kwargs: Any) -> TrainerControl:
        """Call `name` on every callback that has it; a callback returning a TrainerControl replaces it."""
        t = self.trainer
        context = dict(model=t.model, processing_class=t.tokenizer, optimizer=t.optimizer, lr_scheduler=t.scheduler)
        for cb in self.items:
            method = getattr(cb, name, None)
            if callable(method):
                result = method(t.args, t.state, self.control, **context, **kwargs)
                if isinstance(result, TrainerControl):
                    self.control = result
        return self.control

    def take(self, flag: str) -> bool:
        """Read and clear control.<flag> (should_save, should_evaluate, should_log)."""
        value = bool(getattr(self.control, flag))
        setattr(self.control, flag, False)
        return value


EVENTS = (
    "on_init_end", "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_step_begin",
    "on_step_end", "on_log", "on_evaluate", "on_save",
)

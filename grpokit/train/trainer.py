"""GRPOTrainer: TRL's interface over grpokit's parts, and the loop that calls them.

One optimizer step, top to bottom (`train` -> `train_step`):
  1. while the buffer holds fewer micro-batches than the step takes: pipeline.next() -> ScoredBatch (the
     collector: prompts, episodes, rewards, dynamic sampling, advantages), learner.prepare() -> Experience (old /
     reference log-probs, the mismatch weights, the loss mask);
  2. learner.step() over the next gradient_accumulation_steps micro-batches, in TRL's order (pipeline.py):
     policy_loss, backward, clipping, AdamW;
  3. the loop's bookkeeping: counters, adaptive entropy, reference sync, the metrics row (telemetry), logs,
     evaluation, checkpoints, callbacks, signals.
This file does no math and no I/O of its own: grpokit/train/ holds a part per job (docs/architecture.md);
hf_api.py holds transformers' methods around train() (save_model, log_metrics, push_to_hub, ...).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from grpokit.train.callbacks import Callbacks
from grpokit.config import ConfigError, GRPOConfig
from grpokit.config.fsdp import refuse_deepspeed
from grpokit.config.process import runs_on_cpu
from grpokit.distributed import close_process_group, die_with_launcher
from grpokit.train.hub import try_push
from grpokit.observe.metrics import check_sinks
from grpokit.rewards import RewardError
from grpokit.rollout.environments import EnvironmentContractError
from grpokit.rollout.generate import eos_token_ids
from grpokit.train.batches import Experience, TrainerState
from grpokit.train.checkpointer import Checkpointer, RandomState, SaveError, read_state
from grpokit.train.asynchronous import Ahead, GenerationStalled, ShadowPolicy, shadow_copy
from grpokit.train.shadow import SnapshotPolicy, streams_snapshots
from grpokit.train.collector import Collector
from grpokit.train.engines import make_engine, samples_elsewhere
from grpokit.train.comm import Comm
from grpokit.train.evaluator import Evaluator
from grpokit.train.hf_api import TrainerAPI, TrainResult, apply_dataset_rules, refuse_unsupported
from grpokit.train.learner import EntropyControl, Learner, NonFiniteError, nonfinite_message
from grpokit.train.pipeline import ExperienceBuffer, Synchronous
from grpokit.train.setup import (Setup, build_setup, epoch_micro_batches, eval_label, eval_rows, model_init_kwargs,
                                 total_steps)
from grpokit.train.telemetry import Telemetry, summary_row, trl_metric_names

logger = logging.getLogger("grpokit")

__all__ = ["GRPOTrainer", "NonFiniteError", "SaveError", "TrainerState", "TrainResult", "Experience"]


class GRPOTrainer(TrainerAPI):
    """TRL's GRPOTrainer interface (same arguments, same reward-function contract) over grpokit's loop.

    model: a path or hub name, a PreTrainedModel, or a PeftModel (its adapter trains; the reference is the base
    model with the adapter switched off). reward_funcs: one or a list of reward functions, built-in names, import
    paths, reward-service URLs, or reward models (paths, names or AutoModelForSequenceClassification objects);
    None or [] is refused, as TRL does without an environment. train_dataset: a Dataset or, with max_steps, an
    IterableDataset (see grpokit.data.take_rows). eval_dataset: a Dataset, an IterableDataset, or several
    named ones (a DatasetDict or a dict), each evaluated and logged as eval/<name>/... processing_class: the
    policy's tokenizer (default: the one saved beside the model). reward_processing_classes: a tokenizer per
    reward function, used by reward models. callbacks: transformers TrainerCallback objects, called at the
    events grpokit/train/callbacks.py lists with this trainer's args and state; control.should_training_stop /
    should_save / should_evaluate are honoured.
    optimizers: (optimizer, lr_scheduler) to use instead of AdamW and the configured schedule (either may be
    None). peft_config: wrap the model with this PEFT adapter. compute_metrics: functions with the reward
    contract scored on eval completions only (eval/metrics/<name>/mean, and pass@G for 0/1 values).
    tools: functions the model may call (type hints and a docstring; or TOOLS names / import paths), added to
    the config's `tools` (`trainer.tools = [...]` replaces them later, as in TRL). environment_factory: a callable
    returning an environment, or {name: callable} chosen by each row's `environment` column
    (grpokit/rollout/environments.py). Either one makes every rollout a multi-turn episode
    (grpokit/rollout/multiturn.py, docs/tools.md).
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None,
                 callbacks: list | None = None, optimizers: tuple = (None, None), quantization_config=None,
                 peft_config=None, tools=None, rollout_func=None, environment_factory=None,
                 compute_metrics: Any = None) -> None:
        self.args = args = args or GRPOConfig()
        refuse_unsupported(quantization_config=quantization_config, rollout_func=rollout_func)
        self.callbacks = Callbacks(callbacks, self)  # checked now; called from on_init_end, at the end
        refuse_deepspeed(os.environ)  # an accelerate DeepSpeed file: the FSDP2 equivalent, before accelerate fails
        self.accelerator = Accelerator(cpu=runs_on_cpu(args.use_cpu))
        self.comm = comm = Comm(self.accelerator)
        if comm.size > 1:
            atexit.register(close_process_group)  # drained before destroyed: no gloo deadlock at exit
        die_with_launcher()  # a torchrun worker stops, with a checkpoint, when its launcher dies
        check_sinks(args.report_to)
        check_output_dir(args.output_dir)
        apply_dataset_rules(args, train_dataset, eval_dataset)
        self.setup = setup = build_setup(
            args, comm.size, model, reward_funcs, train_dataset, eval_dataset, processing_class,
            reward_processing_classes, tools, environment_factory, compute_metrics, peft_config, str(comm.device))
        self.eval_dataset = eval_dataset  # as given (TRL's attribute); eval_datasets: the checked sets by name
        self.state = TrainerState(max_steps=setup.max_steps, entropy_coef=args.entropy_coef,
                                  is_world_process_zero=comm.is_main,
                                  is_local_process_zero=self.accelerator.is_local_main_process)
        self.learner = Learner(args, comm, model, model_init_kwargs(args), peft_config, optimizers, setup.max_steps,
                               setup.geometry.reuses_batch,
                               args.vllm_importance_sampling_correction and samples_elsewhere(args),
                               setup.tokenizer.pad_token_id, setup.rewards, setup.agent.agentic)
        warn_sequence_level_token_sum(args)
        self.eos_ids = eos_token_ids(self.learner.unwrapped, setup.tokenizer)
        self.engine, self.pipeline = None, None
        self._connect(setup)
        geometry = setup.geometry
        self.buffer = ExperienceBuffer(geometry.micro_batches_per_generation, args.num_iterations,
                                       args.gradient_accumulation_steps, args.per_device_train_batch_size, comm.rank)
        self.run_micro_batches = epoch_micro_batches(args, geometry, len(setup.train_dataset))
        self.checkpointer = Checkpointer(args, comm)
        self.entropy_control = EntropyControl.from_args(args)
        self._last_eval_step: int | None = None
        self._stop_signal: int | None = None
        self.callbacks.event("on_init_end")

    def _connect(self, setup: Setup) -> None:
        """The parts that read the setup's prompts and tools: the engine (kept when it holds the longest sequence),
        collector (keeping the data position), pipeline and evaluator; telemetry's multi-turn metrics."""
        old, position = self.engine, self.pipeline.state_dict() if self.pipeline is not None else None
        longest = max(map(len, setup.prompt_ids + [p for ids in setup.eval_prompt_ids.values() for p in ids]))
        if old is not None and longest + self.args.max_completion_length <= self.collector.max_model_length:
            engine, max_model_length = old, self.collector.max_model_length
        else:
            if old is not None:
                old.close()
            engine, max_model_length = make_engine(setup, self.learner.unwrapped, self.learner.autocast, self.eos_ids,
                                                   self.learner.weights, self.learner.fsdp is not None)
        self.setup, self.engine = setup, engine
        self.collector = Collector(setup, self.comm, self.learner, engine, self.eos_ids, max_model_length)
        if self.pipeline is not None:
            self.pipeline.close()
        self.pipeline = self._ahead(setup, engine, max_model_length) if self.args.max_staleness > 0 \
            else Synchronous(self.collector)
        if position is not None:
            self.pipeline.load_state_dict(position)
        self.evaluator = Evaluator(setup, self.collector, self.learner)
        if getattr(self, "telemetry", None) is None:  # kept across a new setup: its files may be open
            self.telemetry = Telemetry(self.args, self.comm, setup.train_dataset, setup.rewards.names,
                                       setup.rewards.weights, setup.agent.agentic)
        self.telemetry.agentic = setup.agent.agentic

    def _ahead(self, setup: Setup, engine, max_model_length: int) -> Ahead:
        """The asynchronous pipeline: its own collector, its own process group, and the engine (vLLM: the same one,
        pushed the published snapshots' tensors as they are, no copy of the model, where every parameter trains;
        local: one more, generating from a shadow copy of the policy)."""
        if self.learner.fsdp is not None:
            raise ConfigError("max_staleness > 0 (asynchronous rollouts) with FSDP is not supported yet: train "
                              "asynchronously with DDP, or synchronously (max_staleness=0) with FSDP.")
        if streams_snapshots(self.learner.unwrapped, self.args.resolved_rollout_engine):
            shadow = SnapshotPolicy(self.learner.unwrapped.state_dict(), self.learner.version)  # no model copy
        else:
            shadow = ShadowPolicy(shadow_copy(self.learner.unwrapped), self.learner.version)
        if self.args.resolved_rollout_engine == "local":
            engine, _ = make_engine(setup, shadow.model, self.learner.autocast, self.eos_ids, shadow.weights)
        producer = Collector(setup, self.comm.for_generation(), shadow, engine, self.eos_ids, max_model_length,
                             pushed=self.collector.pushed)
        return Ahead(producer, self.learner, setup.geometry.uses_per_generation,
                     self.args.gradient_accumulation_steps, self.args)

    # ------------------------------------------------------------------ TRL's attributes
    model = property(lambda self: self.learner.model)
    ref_model = property(lambda self: self.learner.ref_model)
    optimizer = property(lambda self: self.learner.optimizer)
    scheduler = lr_scheduler = property(lambda self: self.learner.scheduler)
    unwrapped = property(lambda self: self.learner.unwrapped)
    loss_settings = property(lambda self: self.learner.settings)
    tokenizer = property(lambda self: self.setup.tokenizer)
    # TRL's processing_class: the processor of a vision-language run (saved beside the model), else the tokenizer
    processing_class = property(lambda self: self.setup.tokenizer if self.setup.images is None
                                else self.setup.images.processor)
    train_dataset = property(lambda self: self.setup.train_dataset)
    eval_datasets = property(lambda self: self.setup.eval_datasets)
    prompt_ids = property(lambda self: self.setup.prompt_ids)
    eval_prompt_ids = property(lambda self: self.setup.eval_prompt_ids)
    reward_funcs = property(lambda self: self.setup.rewards.funcs)
    reward_weights = property(lambda self: self.setup.rewards.weights)
    reward_names = property(lambda self: list(self.setup.rewards.names))
    reward_func_names = reward_names  # TRL's name, environments' get_reward included
    reward_processing_classes = property(lambda self: self.setup.rewards.processing_classes)
    toolbox = property(lambda self: self.setup.agent.toolbox)
    environments = property(lambda self: self.setup.agent.environments)
    entropy_coef = property(lambda self: self.state.entropy_coef)  # the bonus's coefficient now
    # grpokit adds no Mixture-of-Experts load-balancing loss (TRL 1.16 does, with router_aux_loss_coef)
    aux_loss_enabled = False

    # ------------------------------------------------------------------ the loop
    def train(self, resume_from_checkpoint: bool | str | None = None) -> TrainResult:
        """Train to max_steps (or resume and continue to this run's max_steps). Returns TRL's TrainOutput
        (global_step, training_loss, metrics) that also reads as the state (hf_api.TrainResult); a run stopped by
        SIGTERM/SIGINT returns after saving a checkpoint, with state.interrupted set to the signal's name. A
        finished run ends log_history with TRL's closing row (train_loss, train_runtime, ...; see _finish).
        output_dir is locked while it runs: a second run on the same folder is refused (ConfigError)."""
        with self.checkpointer.holding_output_dir():
            return self._train(resume_from_checkpoint)

    def _train(self, resume_from_checkpoint: bool | str | None) -> TrainResult:
        checkpoint = self.checkpointer.resume_path(resume_from_checkpoint)
        if checkpoint is not None:
            self.checkpointer.load(checkpoint, self.checkpoint_parts())
        self.state.interrupted = None
        self.telemetry.open(self.state)
        previous_handlers = self._install_signal_handlers()
        started, first_step, losses, summary = time.perf_counter(), self.state.global_step, [], None
        total = self.run_micro_batches or self.state.max_steps * self.args.gradient_accumulation_steps
        try:
            self.pipeline.start(self.state, total)
            if self._run(losses):
                summary = self._summary(started, first_step, losses)
                self._finish(summary)
        except KeyboardInterrupt:  # user code raised it, or Ctrl-C came while user code held SIGINT: a stop
            if self.state.global_step == 0:  # nothing trained, nothing to save
                raise
            self.state.interrupted = signal.SIGINT.name
            self._save_after_failure("KeyboardInterrupt")
        except (RewardError, EnvironmentContractError, GenerationStalled) as exc:  # user code failed or hung
            self._save_after_failure(type(exc).__name__)
            raise
        finally:
            self.pipeline.close()
            self._restore_signal_handlers(previous_handlers)
            self.telemetry.close()
        summary = summary or self._summary(started, first_step, losses)
        metrics = {key: value for key, value in summary.items() if key != "step"}
        return TrainResult(self.state, summary["train_loss"], metrics)

    def _summary(self, started: float, first_step: int, losses: list[float]) -> dict[str, float]:
        per_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps * self.comm.size
        return summary_row(self.state, time.perf_counter() - started, first_step, losses, per_step)

    def _run(self, losses: list[float]) -> bool:
        """The loop, to max_steps or a stop; False when a signal stopped it (the rest of train() is skipped)."""
        args, state, callbacks = self.args, self.state, self.callbacks
        callbacks.event("on_train_begin")
        callbacks.event("on_epoch_begin")
        if args.eval_on_start and state.global_step == 0 and self.eval_datasets:
            self._evaluate()
        window: list[dict[str, float]] = []
        progress_at = state.global_step
        while state.global_step < state.max_steps:
            epochs_before = math.floor(state.epoch)
            callbacks.event("on_step_begin")
            window.append(self.train_step())
            losses.append(window[-1].get("loss", math.nan))
            step = state.global_step
            logged = self.telemetry.window_row(window, state) if self.telemetry.log_due(step, state.max_steps) else None
            if logged is not None:
                callbacks.event("on_log", logs=logged)
                self.telemetry.publish(logged)
            progress = self.telemetry.progress
            if progress is not None and (progress.bar is not None or logged is not None):
                progress.update(logged or window[-1] | {"step": step}, step - progress_at)  # the bar every step
                progress_at = step
            if logged is not None:
                window = []
            epoch_ended = math.floor(state.epoch) > epochs_before
            if epoch_ended:
                callbacks.event("on_epoch_end")
            control = callbacks.event("on_step_end")
            asked_eval, asked_save = callbacks.take("should_evaluate"), callbacks.take("should_save")
            if self.eval_datasets and (self._eval_due(step, epoch_ended) or asked_eval):
                self._evaluate()
            stop = self.comm.any(self._stop_signal is not None)
            if stop or asked_save or self._save_due(step, epoch_ended):
                self.save_checkpoint()
            self.pipeline.publish(state)  # after evaluation and checkpoint: the producer may use the new weights
            if stop:
                state.interrupted = signal.Signals(self._stop_signal or signal.SIGTERM).name
                logger.warning("Stopped by signal %s after step %d; checkpoint saved.", self._stop_signal, step)
                return False
            if control.should_training_stop:
                logger.info("A callback stopped training after step %d.", step)
                break
            if epoch_ended:
                callbacks.event("on_epoch_begin")
        return True

    def train_step(self) -> dict[str, float]:
        """One optimizer step (generating a batch first when none is left); its metrics row as numbers."""
        args, state, started = self.args, self.state, time.perf_counter()
        count = args.gradient_accumulation_steps  # the last step of an epochs run takes what is left (TRL)
        if self.run_micro_batches is not None:
            count = max(1, min(count, self.run_micro_batches - state.global_step * count))
        fresh = []  # the generation batches this step starts: their metrics and completions are logged with it
        while self.buffer.left < count:  # a step may end in the next generation batch, or span several
            batch = self.pipeline.next(state)
            state.num_input_tokens_seen += int(batch.lengths.sum())
            experience, prepared = self.learner.prepare(batch, self.collector.advantages)
            self.buffer.put(experience)
            fresh.append((batch, prepared, experience, state.num_input_tokens_seen))
        self._keep_signal_handlers()
        experience, rows = self.buffer.take(count)
        coef = self.entropy_control.applied(state.entropy_coef, state.last_entropy)
        stats = self.learner.step(experience, rows, coef)
        if stats.skipped:  # the gradients were dropped; neither the optimizer nor the schedule advanced
            state.nonfinite_skips += 1
            state.consecutive_nonfinite_steps += 1
            if state.consecutive_nonfinite_steps >= args.max_consecutive_nonfinite_steps:
                raise NonFiniteError(nonfinite_message(state.consecutive_nonfinite_steps, state.global_step + 1, stats))
        else:
            state.consecutive_nonfinite_steps = 0
            if stats.entropy is not None:  # adaptive entropy control
                state.entropy_coef = self.entropy_control.next(state.entropy_coef, stats.entropy)
                state.last_entropy = stats.entropy
        row = self.telemetry.step_row(stats, state, fresh)
        state.global_step += 1
        state.epoch = self.pipeline.epoch
        if args.sync_ref_model and state.global_step % args.ref_model_sync_steps == 0:
            self.learner.sync_reference()
        ended = time.perf_counter()
        row.update(self.pipeline.step_metrics(started, ended))
        row["step_seconds"] = ended - started
        row["learning_rate"] = self.scheduler.get_last_lr()[0]
        return row

    def _finish(self, summary: dict[str, float]) -> None:
        """After the last step: the eval set (if not just evaluated), the best model when load_best_model_at_end,
        the final model and tokenizer in output_dir, push_to_hub, TRL's closing row (passed to on_log), on_train_end.
        As under TRL, the closing row is a log_history row of its own, unless logging_steps did not schedule the last
        step's row (logged only because it is the last): TRL's closing row holds those steps' means, so that row
        gets the closing values."""
        args, state = self.args, self.state
        if self.eval_datasets and self._last_eval_step != state.global_step:
            self._evaluate()
        if args.load_best_model_at_end and state.best_model_checkpoint:
            self.learner.load_weights(Path(state.best_model_checkpoint))
        self.save_model(args.output_dir)
        if args.push_to_hub and self.comm.is_main:
            state.pushed_to = try_push(args.output_dir, args.hub_model_id, args.hub_private_repo)
        last, step = (state.log_history or [{}])[-1], state.global_step
        on_schedule = step % args.logging_steps == 0 or (args.logging_first_step and step == 1)
        if last.get("step") == step and "loss" in last and not on_schedule:
            last.update(summary)  # TRL logs these steps only in its closing row, with their means
        else:
            state.log_history.append(summary)
        self.callbacks.event("on_log", logs=summary)
        self.callbacks.event("on_train_end")

    def _eval_due(self, step: int, epoch_ended: bool) -> bool:
        strategy = self.args.eval_strategy
        if strategy == "steps":
            return step % (self.args.eval_steps or self.args.logging_steps) == 0
        return strategy == "epoch" and epoch_ended

    def _save_due(self, step: int, epoch_ended: bool) -> bool:
        strategy = self.args.save_strategy
        return (strategy == "steps" and step % self.args.save_steps == 0) or (strategy == "epoch" and epoch_ended)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None) -> dict[str, float]:
        """Evaluate on the trainer's eval sets (or on `eval_dataset`: a Dataset, or named ones as a dict) and
        return the metrics (see Evaluator.run) under grpokit's names (eval/reward, eval/<set>/loss) and TRL's
        (eval_reward, eval_<set>_loss); the log_history row has grpokit's names."""
        if eval_dataset is None:
            sets, result = self.eval_datasets, self._evaluate()
        else:
            sets = eval_rows(eval_dataset)
            if self.environments is not None:
                for dataset in sets.values():
                    self.environments.check_rows(dataset)
            ids = {name: self.setup.tokenize(ds, f" of {eval_label(name)}") for name, ds in sets.items()}
            result = self._evaluate(sets, ids)
        return {**result, **trl_metric_names(result, list(sets))}

    def _evaluate(self, sets=None, prompt_ids=None) -> dict[str, float]:
        """Run the evaluator, log its row, tell the callbacks, keep the best model."""
        sets = self.eval_datasets if sets is None else sets
        self.pipeline.quiesce()  # the producer stops with nothing half-made: the engine is the evaluator's
        result = self.evaluator.run(sets, self.eval_prompt_ids if prompt_ids is None else prompt_ids, self.state)
        self._last_eval_step = self.state.global_step
        self.state.log_history.append(result)
        self.telemetry.write(result)
        # TRL's names as well (eval_reward for eval/reward), which callbacks such as EarlyStoppingCallback read;
        # called before the best model is updated, as transformers does, so state.best_metric is the previous best
        self.callbacks.event("on_evaluate", metrics={**result, **trl_metric_names(result, list(sets))})
        self.checkpointer.track_best(result, self.state, self._write_model, self.learner.gathered)
        return result

    # ------------------------------------------------------------------ checkpoints
    def _write_model(self, folder: Path) -> None:
        self.learner.write_model(folder, self.processing_class)

    def save_checkpoint(self) -> Path:
        self.pipeline.quiesce()  # every batch the published weights can make is made, and saved with the step
        final = self.checkpointer.save(self.state.global_step, self.checkpoint_parts())
        self.callbacks.event("on_save")
        return final

    def checkpoint_parts(self) -> dict[str, Any]:
        """What a checkpoint holds, by its key in trainer_state.json (file-only parts write no key)."""
        return {"model": _Part(lambda folder: self.learner.save(folder, self.processing_class),
                               lambda folder, _: self.learner.load(folder, read_state(folder).get("num_processes"))),
                "rng": RandomState(self.comm.rank),
                "trainer": _Part(lambda folder: dataclasses.asdict(self.state), self._load_state),
                "sampler": _Part(lambda folder: self.pipeline.state_dict(),
                                 lambda folder, saved: self.pipeline.load_state_dict(saved)),
                "last_generation_metrics": _Part(lambda folder: self.telemetry.state_dict(),
                                                 lambda folder, saved: self.telemetry.load_state_dict(saved or {})),
                "experience": _Part(self.buffer.save, lambda folder, _: self.buffer.load(folder), per_process=True),
                "rollouts": _Part(self.pipeline.save, lambda folder, _: self.pipeline.load(folder), per_process=True)}

    def _load_state(self, folder: Path, saved: dict[str, Any]) -> None:
        self.state = TrainerState(**{**saved, "is_world_process_zero": self.comm.is_main,
                                     "is_local_process_zero": self.accelerator.is_local_main_process})
        # this run's max_steps, not the checkpointed run's
        self.state.max_steps = total_steps(self.args, self.setup.geometry, len(self.train_dataset))
        self.run_micro_batches = epoch_micro_batches(self.args, self.setup.geometry, len(self.train_dataset))

    def _save_after_failure(self, what: str) -> None:
        """Checkpoint the last finished step when user code stopped the next one (nothing trained is lost; the
        failed batch's prompts are skipped on resume), unless it is saved already or nothing was trained. Only a
        single process saves: with several, the others wait in a collective the failed one never reaches."""
        step = self.state.global_step
        if self.comm.size > 1 or step == 0 or (Path(self.args.output_dir) / f"checkpoint-{step}").is_dir():
            return
        try:
            path = self.save_checkpoint()
        except Exception as exc:  # noqa: BLE001 - the user code's error is the one to report
            logger.error("%s stopped the run after step %d, and its checkpoint could not be saved: %s", what, step, exc)
            return
        logger.warning("%s stopped the run after step %d; that step is saved in %s.", what, step, path)

    # ------------------------------------------------------------------ signals
    def _install_signal_handlers(self):
        def request_stop(signum, frame):
            self._stop_signal = signum

        try:
            previous = {s: signal.signal(s, request_stop) for s in (signal.SIGTERM, signal.SIGINT)}
        except ValueError:  # not the main thread: leave signals alone
            return {}
        self._stop_handler = request_stop
        return previous

    def _keep_signal_handlers(self) -> None:
        """Put the stop handlers back where user code (a reward function, an environment, a callback) replaced
        them, before the optimizer step: Ctrl-C then always stops at the end of a step, with a checkpoint."""
        handler = getattr(self, "_stop_handler", None)
        for signum in (signal.SIGTERM, signal.SIGINT) if handler is not None else ():
            if signal.getsignal(signum) is not handler:
                name = signal.Signals(signum).name
                logger.warning("User code replaced the %s handler; the trainer's is put back.", name)
                signal.signal(signum, handler)

    def _restore_signal_handlers(self, previous) -> None:
        self._stop_handler = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@dataclasses.dataclass(frozen=True)
class _Part:
    """A checkpoint part made of two functions (see grpokit.train.checkpointer.Stateful)."""

    save: Any
    load: Any
    per_process: bool = False  # this process's own files: not read by a run with another number of processes


def check_output_dir(output_dir: str) -> None:
    path = Path(output_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".grpokit-write-test-{os.getpid()}"  # one per process: ranks check at the same time
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"output_dir {output_dir!r} is not writable ({exc.strerror}); choose another folder.") from exc


def warn_sequence_level_token_sum(args: GRPOConfig) -> None:
    """GSPO's sequence-level ratio with an aggregation that sums tokens: each sequence then counts in proportion
    to its length, which is not GSPO's objective."""
    objective, aggregation = args.resolved_loss
    if args.importance_sampling_level == "sequence" and aggregation != "grpo" and objective in ("clip", "cispo"):
        logger.warning(
            "importance_sampling_level='sequence' with loss_type=%r: the loss adds up per-token terms, which weights "
            "each sequence by its completion length instead of optimising the per-sequence (GSPO) objective; set "
            "loss_type='grpo' for GSPO as published.", args.loss_type)

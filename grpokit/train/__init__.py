"""The trainer, as parts with one job each (docs/architecture.md):

setup.py (everything built before step 1), collector.py (prompts -> episodes -> rewards -> ScoredBatch; engines.py:
making the rollout engine, the pushed version),
learner.py (models, optimizer; with learner_passes.py: log-prob passes, prepare -> Experience; learner_step.py: step
-> StepStats; learner_state.py: checkpoints), weights.py (the weight stream), pipeline.py (the
producer of batches, the experience buffer; asynchronous.py, shadow.py, heartbeat.py: the producer thread),
evaluator.py, checkpointer.py (with atomic.py and output_lock.py), telemetry.py, comm.py (the parts'
collectives), batches.py (the plain data between them) and trainer.py (GRPOTrainer, TRL's API, and the loop; with
hf_api.py: transformers Trainer's methods, callbacks.py, hub.py). Beside them: fsdp.py, distcp.py and
gloo_collectives.py (FSDP2 and its checkpoints), memory.py and in_place.py (memory and in-place gradients).

`from grpokit.train import GRPOTrainer` imports lazily, so a part (e.g. the checkpointer) imports alone.
"""

__all__ = ["GRPOTrainer", "NonFiniteError", "SaveError", "TrainerState", "TrainResult"]


def __getattr__(name: str):
    if name in __all__:
        from grpokit.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'grpokit.train' has no attribute {name!r}")

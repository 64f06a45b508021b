#!/usr/bin/env bash
# The lowest versions pyproject.toml names, installed exactly (==) in a venv of their own (.venv-min), and a smoke
# run on them (tests/scripts/smoke_min_versions.py): proof that the floors are right. CI runs it (.ci/run).
# torch comes from PyPI here (no CPU index needed): at its floor that is a CUDA build, which runs on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
rm -rf .venv-min
"$PY" -m venv .venv-min
pins=$("$PY" - <<'PYEOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(" ".join(re.sub(r">=", "==", d) for d in deps))
PYEOF
)
echo "min_versions: installing $pins"
# tqdm, numpy and other transitive packages resolve to what these pins allow
timeout 1200 .venv-min/bin/pip install -q $pins
timeout 300 .venv-min/bin/pip install -q --no-deps -e .
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout 600 .venv-min/bin/python tests/scripts/smoke_min_versions.py

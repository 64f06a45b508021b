"""The user-objective example in docs/algorithms.md runs as written, and the docs name every registered choice."""

import re
import sys
from pathlib import Path

from grpokit.algorithms import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_SAMPLING_LEVELS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    POLICY_OBJECTIVES,
    objective_aggregations,
)
from procs import run_tree

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "algorithms.md").read_text()


def test_the_user_objective_example_trains(tmp_path):
    code = re.search(r"<!-- example: user-objective -->\n```python\n(.*?)```", DOC, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    result = run_tree([sys.executable, str(script)], 300, cwd=tmp_path)  # its whole tree dies on timeout
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 4 steps with truncated_is" in result.stdout
    assert (tmp_path / "outputs" / "truncated_is" / "model.safetensors").is_file()


def test_the_objective_table_gives_each_objective_its_registered_aggregation():
    rows = {line.split(" | ")[0].strip("|` "): line.split(" | ")[2].strip("` ")
            for line in DOC.splitlines() if line.startswith("| `")}
    assert {name: rows.get(name) for name in POLICY_OBJECTIVES} == objective_aggregations()


def test_the_docs_name_every_registered_choice():
    for registry in (POLICY_OBJECTIVES, LOSS_AGGREGATIONS, IMPORTANCE_SAMPLING_LEVELS, ADVANTAGE_ESTIMATORS,
                     KL_ESTIMATORS):
        for name in registry:
            assert f"`{name}`" in DOC or f"{name} =" in DOC, (registry.option, name)

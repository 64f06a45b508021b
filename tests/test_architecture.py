"""The layer table of docs/architecture.md, held by the code: every import of a grpokit module (at the top of a
file or inside a function) goes to a module of a lower layer, or stays inside its own package.

A "module" here is a top-level package of grpokit (rollout, train, ...) or a top-level module file (errors.py,
...). The table lives in docs/architecture.md between the markers below; this test reads it from there, so the
document and the code cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grpokit"
DOC = ROOT / "docs" / "architecture.md"
# Sideways edges that remain (a circle to remove): data.py reads reasoning-gym specs lazily, and the reward
# registry offers reasoning-gym's scorer as a built-in; tasks/ imports both.
SIDEWAYS = {("data", "tasks"), ("rewards", "tasks")}


def layer_table() -> dict[str, int]:
    """module -> layer, from the doc's table (rows `| n | a, b, c |` between the layer markers)."""
    text = DOC.read_text()
    block = text.split("<!-- layers: start -->")[1].split("<!-- layers: end -->")[0]
    table = {}
    for layer, names in re.findall(r"^\|\s*(\d+)\s*\|([^|]+)\|", block, re.MULTILINE):
        for name in names.split(","):
            table[name.strip().strip("`")] = int(layer)
    return table


def owner(module: str) -> str | None:
    """The top-level grpokit module that `module` (a dotted name) belongs to; None outside grpokit."""
    parts = module.split(".")
    if parts[0] != "grpokit":
        return None
    return parts[1] if len(parts) > 1 else "grpokit"


def imported(path: Path) -> set[str]:
    """Every grpokit module a file imports, wherever the import is written."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(filter(None, (owner(alias.name) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "grpokit":  # `from grpokit import packing`: the names are the modules
                found.update(alias.name if (PACKAGE / alias.name).exists() or (PACKAGE / f"{alias.name}.py").exists()
                             else "grpokit" for alias in node.names)
            elif owner(node.module) is not None:
                found.add(owner(node.module))
    return found


def edges() -> set[tuple[str, str]]:
    result = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        source = "grpokit" if relative == Path("__init__.py") else relative.parts[0].removesuffix(".py")
        result.update((source, target) for target in imported(path) if target != source)
    return result


def test_every_module_is_in_the_table():
    table = layer_table()
    modules = {p.name.removesuffix(".py") for p in PACKAGE.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert modules | {"grpokit"} == set(table), "docs/architecture.md's layer table and grpokit's modules differ"


def test_imports_go_down_the_layers():
    table = layer_table()
    upward = sorted(f"{a} (layer {table[a]}) imports {b} (layer {table[b]})" for a, b in edges() - SIDEWAYS
                    if table[b] >= table[a])
    assert not upward, "imports against docs/architecture.md's layer table:\n" + "\n".join(upward)


def test_rollout_never_imports_the_trainer():
    assert ("rollout", "train") not in edges()


def test_the_sideways_edges_are_still_needed():
    """When a listed sideways edge disappears, it leaves SIDEWAYS too (the list never hides a new one)."""
    assert SIDEWAYS <= edges()


def test_files_and_functions_stay_short():
    """No module over 500 lines and no function over 60 (docs/architecture.md: a file holds one idea, a function
    reads at once)."""
    long_files = [f"{p.relative_to(ROOT)}: {n} lines" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > 500]
    long_functions = [f"{p.relative_to(ROOT)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
                      for p in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.end_lineno - node.lineno + 1 > 60]
    assert not long_files and not long_functions, "\n".join(long_files + long_functions)

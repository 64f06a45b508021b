"""Judge assert-style tests outside the sandbox, so that no program can forge its verdict.

A test snippet (``assert add(1, 2) == 3``, several asserts, setup lines, or a HumanEval ``def check(candidate):
...`` + ``check(f)``) is read with `ast` and split:

- the parts that need the program ("leaves": a call into it, a name it defines) are sent into the sandbox,
  where the harness (`_harness.py`) evaluates them after the solution and reports plain data (exact types:
  None, bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset; anything else fails);
- the rest (literals, operators, comparisons, ``not``, ``and``/``or``, a few pure built-ins such as ``len``,
  ``sorted``, ``abs``, ``round``, ``math.isclose``) is evaluated here, by the judge, on those plain values. The
  expected side of a comparison never enters the sandbox; a bare ``assert x`` is true when the value is truthy
  (compared here), ``assert not x`` when it is falsy;
- parts that need the test's own code but not the program (a reference function defined in the snippet:
  ``assert f(5) == ref(5)``) run in a second, clean sandbox run without the solution, so the program cannot
  patch them; a test function applied to the program's values (``assert close(f(2), 4.0)``) runs in a clean
  run too, after the program's run, on those values written as literals (`deferred_program`).

A snippet the judge cannot split (an assert inside a loop it cannot unroll, inside ``if``/``try``/``with``, or
inside a function other than the HumanEval check) is *opaque*: it can only run whole inside the sandbox, where
the program can fake its verdict (see `Plan.opaque`; CodeExecutionReward runs or fails them as configured).

Layout: `_judge_plan.py` (splitting a snippet into a `Plan`), `_judge_eval.py` (the judge's own evaluation over
plain values, and values written as literals), this module (the harness program, reading the harness's record,
the deferred run and the verdict).
"""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from typing import Any

from grpokit.sandbox._judge_eval import (
    JUDGE_FUNCTIONS,
    MATH_CONSTANTS,
    MATH_FUNCTIONS,
    PLAIN_TYPES,
    _MISSING,
    JudgeError,
    _literal_source,
    check_hashing,
    _Raised,
    evaluate,
)
from grpokit.sandbox._judge_plan import Check, Plan, plan_snippet

__all__ = [
    "JUDGE_FUNCTIONS",
    "MATH_CONSTANTS",
    "MATH_FUNCTIONS",
    "PLAIN_TYPES",
    "Check",
    "JudgeError",
    "Plan",
    "RunValues",
    "check_hashing",
    "decode_value",
    "deferred_program",
    "evaluate",
    "harness_program",
    "judge",
    "plan_snippet",
    "read_record",
]

_HARNESS_SOURCE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness.py"),
                       encoding="utf-8").read()


def harness_program(code: str, steps: list[list[str]], keep_going: bool) -> str:
    """The program the sandbox runs: the harness, then a call with the payload (the solution travels as data)."""
    payload = json.dumps({"code": code, "steps": steps, "keep_going": keep_going})
    return f"{_HARNESS_SOURCE}\n\nrun(__import__('json').loads({payload!r}))\n"


# --- decoding what the harness reported --------------------------------------------------------------------------


class _Bad(Exception):
    pass


def decode_value(data: Any, depth: int = 0) -> Any:
    """Rebuild a plain value from the harness's encoding; raise _Bad for anything that does not match it."""
    if depth > 200 or not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise _Bad("malformed value")
    tag, rest = data[0], data[1:]
    try:
        if tag == "N" and not rest:
            return None
        if tag == "B" and len(rest) == 1 and isinstance(rest[0], bool):
            return rest[0]
        if tag == "I" and len(rest) == 1 and isinstance(rest[0], str):
            return int(rest[0], 16)
        if tag == "F" and len(rest) == 1 and isinstance(rest[0], str):
            return float.fromhex(rest[0])
        if tag == "C" and len(rest) == 2 and all(isinstance(r, str) for r in rest):
            return complex(float.fromhex(rest[0]), float.fromhex(rest[1]))
        if tag == "S" and len(rest) == 1 and isinstance(rest[0], str):
            return rest[0]
        if tag == "Y" and len(rest) == 1 and isinstance(rest[0], str):
            return bytes.fromhex(rest[0])
        if tag in "LTEZ" and len(tag) == 1 and len(rest) == 1 and isinstance(rest[0], list):
            items = [decode_value(item, depth + 1) for item in rest[0]]
            if tag in "EZ":
                check_hashing(items)
            return {"L": list, "T": tuple, "E": set, "Z": frozenset}[tag](items)
        if tag == "D" and len(rest) == 1 and isinstance(rest[0], list):
            pairs = rest[0]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise _Bad("malformed dict")
            decoded = [(decode_value(k, depth + 1), decode_value(v, depth + 1)) for k, v in pairs]
            check_hashing(key for key, _ in decoded)
            return dict(decoded)
    except (ValueError, TypeError, OverflowError, JudgeError) as exc:  # bad hex, unhashable, colliding hashes
        raise _Bad(str(exc)) from None
    raise _Bad(f"unknown value tag {tag!r}")


@dataclass(frozen=True)
class RunValues:
    """What one harness run reported: per eval step, (True, value) or (False, error); or why there is nothing."""

    values: list[tuple[bool, Any]]
    error: str | None = None
    failed_exec: str | None = None  # the error of a statement (not an expression) of the test


def read_record(stdout: str, expected_values: int) -> RunValues:
    """Parse the harness's record strictly: one JSON object, the documented keys, one entry per eval step."""
    try:
        record = json.loads(stdout)
    except (ValueError, RecursionError):
        return RunValues([], "no valid result record (the program exited early or wrote to the result channel)")
    if not isinstance(record, dict) or set(record) != {"solution", "values", "failed_exec"}:
        return RunValues([], "malformed result record")
    if record["solution"] != "ok":
        return RunValues([], f"the solution raised: {str(record['solution'])[:300]}")
    raw = record["values"]
    if not isinstance(raw, list) or len(raw) > expected_values:
        return RunValues([], "malformed result record")
    values: list[tuple[bool, Any]] = []
    for item in raw:
        if isinstance(item, list) and len(item) == 2 and item[0] == "!" and isinstance(item[1], str):
            values.append((False, item[1]))
            continue
        try:
            values.append((True, decode_value(item)))
        except (_Bad, RecursionError) as exc:
            return RunValues([], f"a value is not plain data: {exc}")
    failed = record["failed_exec"]
    if failed is not None and not isinstance(failed, str):
        return RunValues([], "malformed result record")
    return RunValues(values, None, failed)


def _phase_one_env(plan: Plan, program: RunValues, clean: RunValues | None) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for name, (where, index) in plan.slots.items():
        if where == "const":
            env[name] = index
        elif where == "deferred":
            env[name] = _MISSING
        else:
            run = program if where == "program" else clean
            if run is None or index >= len(run.values):
                env[name] = _MISSING
            else:
                ok, value = run.values[index]
                env[name] = value if ok else _Raised(value)
    return env


class _Unavailable(Exception):
    pass


def _inlined(expr: ast.expr, plan: Plan) -> tuple[ast.expr, list[str]]:
    """`expr` with every deferred call inlined (recursively), and the value slots it reads. The values stay names:
    they are bound by statements of their own (`_bind_step`), so no value is ever rendered through the ast module
    (whose `unparse` fails on ints of more than 4,300 digits)."""
    reads: list[str] = []

    class Inline(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            if node.id not in plan.slots:
                return node
            where, payload = plan.slots[node.id]
            if where == "deferred":
                return self.visit(_copy(payload))
            reads.append(node.id)
            return node

    return ast.fix_missing_locations(Inline().visit(_copy(expr))), reads


def _bind_step(name: str, env: dict[str, Any]) -> list[str]:
    """The statement that binds slot `name` to its value, written as a literal, in the clean run."""
    value = env[name]
    if isinstance(value, _Raised):
        raise _Unavailable(f"a value it needs raised {value.message}")
    if value is _MISSING:
        raise _Unavailable("a value it needs was not reached")
    return ["exec", f"{name} = {_literal_source(value)}"]


def _copy(node: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(node), mode="eval").body


def deferred_program(plan: Plan, program: RunValues, clean: RunValues | None) -> tuple[str | None, dict[str, Any]]:
    """The second, clean run for calls of test functions on the program's values (`assert close(f(2), 4.0)`):
    the harness program (None when nothing is left to run) and, per deferred slot, the index of its value in that
    run or why it has none. Only after the program run (and the first clean run) reported. The values are bound
    by statements after the test's own; a value that cannot be written or read back (nested too deep for the
    parser) fails its statement there, and the check fails."""
    if not plan.deferred or program.error is not None:
        return None, {}
    env = _phase_one_env(plan, program, clean)
    binds: dict[str, list[str]] = {}
    evals: list[list[str]] = []
    where: dict[str, Any] = {}
    for name in plan.deferred:
        try:
            expr, reads = _inlined(ast.Name(id=name, ctx=ast.Load()), plan)
            needed = {slot: binds.get(slot) or _bind_step(slot, env) for slot in reads}
        except (_Unavailable, JudgeError) as exc:
            where[name] = _Raised(str(exc))
            continue
        binds.update(needed)
        where[name] = len(evals)
        evals.append(["eval", ast.unparse(expr)])
    if not evals:
        return None, where
    steps = [step for step in plan.clean_steps if step[0] == "exec"] + list(binds.values()) + evals
    return harness_program("", steps, keep_going=True), where


def judge(plan: Plan, program: RunValues, clean: RunValues | None, deferred: RunValues | None = None,
          deferred_slots: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Whether every check of the snippet holds, and why not. Checks run in order; the first failure decides.

    deferred, deferred_slots: the second clean run's values and `deferred_program`'s slot map, when the plan
    has deferred calls."""
    own = "the test's own code failed: "
    for run, what in ((program, ""), (clean, own), (deferred, own)):
        if run is not None and run.error is not None:
            return False, f"{what}{run.error}"
        if run is not None and run.failed_exec is not None:
            return False, f"a statement of the test raised: {run.failed_exec}"
    env = _phase_one_env(plan, program, clean)
    for name, index in (deferred_slots or {}).items():
        if isinstance(index, _Raised):
            env[name] = index
        elif deferred is not None and index < len(deferred.values):
            ok, value = deferred.values[index]
            env[name] = value if ok else _Raised(value)
    for check in plan.checks:
        try:
            if not evaluate(check.expr, env, plan.math_imports):
                return False, f"assert {check.source} failed"
        except JudgeError as exc:
            return False, f"assert {check.source}: {exc}"
    return True, ""

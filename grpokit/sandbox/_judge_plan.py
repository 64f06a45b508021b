"""Splitting a test snippet into a Plan: what runs with the program, what runs clean, what the judge checks.

See grpokit.sandbox.judge for the design; `plan_snippet` is the entry point and never raises (a snippet it
cannot split is opaque).
"""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field
from typing import Any

from grpokit.sandbox._judge_eval import (
    JUDGE_FUNCTIONS,
    MATH_CONSTANTS,
    MATH_FUNCTIONS,
    PLAIN_TYPES,
    JudgeError,
    _literal_source,
    evaluate,
)

@dataclass
class Check:
    """One assert: `expr` (an AST over judge-side names) must be truthy."""

    expr: ast.expr
    source: str


@dataclass
class Plan:
    """How to judge one snippet: the steps of the program run, those of the clean run, and the checks."""

    checks: list[Check] = field(default_factory=list)
    program_steps: list[list[str]] = field(default_factory=list)  # [kind, source]
    clean_steps: list[list[str]] = field(default_factory=list)
    # judge name -> ("program" | "clean", index into that run's values), ("const", value), or ("deferred", call):
    # a call of a function the test defines, on values the program produced (see `deferred_program`)
    slots: dict[str, tuple[str, Any]] = field(default_factory=dict)
    opaque: str | None = None  # why the snippet cannot be split (then it runs whole, forgeable)
    math_imports: dict[str, str] = field(default_factory=dict)  # from math import isclose [as ic]

    @property
    def deferred(self) -> list[str]:
        return [name for name, (where, _) in self.slots.items() if where == "deferred"]


# --- splitting -------------------------------------------------------------------------------------------------


def _bound_names(node: ast.AST) -> set[str]:
    """Names a statement binds at top level (assignment targets, defs, classes, imports, loop targets)."""
    names: set[str] = set()
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            names.add((alias.asname or alias.name).split(".")[0])
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
            names.add(sub.id)
        elif isinstance(sub, (ast.Global, ast.Nonlocal)):
            names.update(sub.names)
    return names


def _loaded_names(node: ast.AST) -> set[str]:
    """Names `node` reads from outside itself: every load, less what it binds inside a function, lambda, class or
    comprehension of its own (parameters, locals, loop variables). An over-approximation, which is the safe side:
    a name wrongly taken as read only keeps more test code with the program run."""
    loads = {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)}
    inner: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.ListComp,
                            ast.SetComp, ast.DictComp, ast.GeneratorExp)) and sub is not None:
            for part in ast.walk(sub):
                if isinstance(part, ast.arg):
                    inner.add(part.arg)
                elif isinstance(part, ast.Name) and isinstance(part.ctx, ast.Store):
                    inner.add(part.id)
    return loads - inner


@dataclass
class _Step:
    kind: str  # "exec" | "eval" | "bind"
    source: str
    loads: set[str] = field(default_factory=set)
    binds: set[str] = field(default_factory=set)
    program_free: bool = False


class _Splitter:
    """Walks a snippet's statements in order and builds the Plan."""

    def __init__(self, snippet_names: set[str]) -> None:
        self.plan = Plan()
        self.program: list[_Step] = []
        self.clean: list[_Step] = []
        self.judge_values: dict[str, Any] = {}  # names whose value the judge knows (computed from test constants)
        self.clean_defined: set[str] = set()  # bound by test code the program has not touched (clean run)
        self.math_names: set[str] = set()  # local names of the math module (import math [as m])
        self.math_imports: dict[str, str] = {}  # from math import isclose [as ic]
        self.snippet_names = snippet_names
        self.pending_taint: set[str] = set()
        self.dry = False
        self.counter = 0

    # An expression node is "judge-side" when the judge can evaluate it from plain values.
    def _judge_call(self, node: ast.Call) -> bool:
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in self.math_imports:
                return True
            return func.id in JUDGE_FUNCTIONS and func.id not in self.snippet_names
        return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id in self.math_names and func.attr in MATH_FUNCTIONS)

    def _passes_functions(self, node: ast.Call) -> bool:
        """A call that passes a function (``sorted(xs, key=len)``, ``key=lambda ...``): the judge does not apply
        functions to values, so the whole call is evaluated inside (it holds no expected value)."""
        for part in list(node.args) + [k.value for k in node.keywords]:
            for sub in ast.walk(part):
                if isinstance(sub, ast.Lambda):
                    return True
                if isinstance(sub, ast.Name) and sub.id not in self.judge_values and sub.id not in PLAIN_TYPES \
                        and callable(getattr(builtins, sub.id, None)) and sub.id not in self.snippet_names:
                    return True
        return False

    def _program_free(self, node: ast.AST) -> bool:
        """Does `node` read only test constants, builtins and names bound by test code the program never saw?"""
        return all(name in self.clean_defined or name in self.judge_values
                   or (hasattr(builtins, name) and name not in self.snippet_names) for name in _loaded_names(node))

    def split(self, node: ast.expr) -> ast.expr:
        """Return a judge-side copy of `node` whose program-dependent parts are replaced by slot names."""
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name):
            if node.id in self.judge_values:
                return self._slot(("const", self.judge_values[node.id]))
            if node.id in PLAIN_TYPES and node.id not in self.snippet_names:
                return self._slot(("const", PLAIN_TYPES[node.id]))
            return self._leaf(node)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            return type(node)(elts=[self.split(e) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Dict) and None not in node.keys:
            return ast.Dict(keys=[self.split(k) for k in node.keys], values=[self.split(v) for v in node.values])
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(op=node.op, operand=self.split(node.operand))
        if isinstance(node, ast.BinOp) and not isinstance(node.op, ast.MatMult):
            return ast.BinOp(left=self.split(node.left), op=node.op, right=self.split(node.right))
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(op=node.op, values=[self.split(v) for v in node.values])
        if isinstance(node, ast.Compare):
            return ast.Compare(left=self.split(node.left), ops=node.ops,
                               comparators=[self.split(c) for c in node.comparators])
        if isinstance(node, ast.IfExp):
            return ast.IfExp(test=self.split(node.test), body=self.split(node.body), orelse=self.split(node.orelse))
        if isinstance(node, ast.Subscript):
            return ast.Subscript(value=self.split(node.value), slice=self.split(node.slice), ctx=ast.Load())
        if isinstance(node, ast.Slice):
            return ast.Slice(*(self.split(p) if p is not None else None for p in (node.lower, node.upper, node.step)))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in self.math_names \
                and node.attr in MATH_CONSTANTS:
            return ast.Constant(MATH_CONSTANTS[node.attr])
        if isinstance(node, ast.Call) and self._judge_call(node) and not any(
                isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords) \
                and not self._passes_functions(node):
            return ast.Call(func=node.func, args=[self.split(a) for a in node.args],
                            keywords=[ast.keyword(arg=k.arg, value=self.split(k.value)) for k in node.keywords])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.clean_defined \
                and not self._program_free(node) and not self.dry and not any(
                isinstance(a, ast.Starred) for a in node.args) and all(k.arg for k in node.keywords) and not any(
                isinstance(sub, ast.Lambda) for part in node.args + [k.value for k in node.keywords]
                for sub in ast.walk(part)):
            # A function of the test applied to what the program returns (`assert close(f(2), 4.0)`): the
            # program's values come back first, then the call runs in a clean run, on them (never in the
            # program's process, where it could be patched, nor with its constants shown to the program).
            call = ast.Call(func=node.func, args=[self.split(a) for a in node.args],
                            keywords=[ast.keyword(arg=k.arg, value=self.split(k.value)) for k in node.keywords])
            return self._slot(("deferred", call))
        return self._leaf(node)

    def _slot(self, where: tuple[str, Any]) -> ast.Name:
        name = f"__slot{self.counter}__"
        self.counter += 1
        self.plan.slots[name] = where
        return ast.Name(id=name, ctx=ast.Load())

    def _binds(self, names: set[str], steps: list[_Step]) -> None:
        """Bind test constants the next step reads, in that run (their values are the judge's)."""
        for name in sorted(names & set(self.judge_values)):
            steps.append(_Step("bind", f"{name} = {_literal_source(self.judge_values[name])}", set(), {name}, True))

    def _leaf(self, node: ast.expr) -> ast.Name:
        if self.dry:
            raise JudgeError("needs a run")
        source, loads = ast.unparse(node), _loaded_names(node)
        if self._program_free(node):
            self._binds(loads, self.clean)
            self.clean.append(_Step("eval", source, loads, set(), True))
            return self._slot(("clean", sum(step.kind == "eval" for step in self.clean) - 1))
        self._binds(loads, self.program)
        self.program.append(_Step("eval", source, loads))
        self.pending_taint |= loads  # the program got these objects: from the next statement on, they are its
        return self._slot(("program", sum(step.kind == "eval" for step in self.program) - 1))

    def _taint(self, names: set[str]) -> None:
        for name in names:
            self.judge_values.pop(name, None)
            self.clean_defined.discard(name)

    def constant(self, node: ast.expr) -> Any:
        """The value of an expression that needs no run, or _NOT_CONSTANT."""
        self.dry = True
        mark = (dict(self.plan.slots), self.counter)
        try:
            return evaluate(self.split(node), {k: v[1] for k, v in self.plan.slots.items() if v[0] == "const"},
                            self.math_imports)
        except (JudgeError, RecursionError):
            return _NOT_CONSTANT
        finally:
            self.plan.slots, self.counter = mark
            self.dry = False

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assert):
            self.pending_taint = set()
            expr = self.split(stmt.test)
            self.plan.checks.append(Check(expr, ast.unparse(stmt.test)))
            self._taint(self.pending_taint)
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return  # a docstring
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = self.constant(stmt.value)
            if value is not _NOT_CONSTANT:
                self.judge_values[stmt.targets[0].id] = value
                self.clean_defined.discard(stmt.targets[0].id)
                return
        if isinstance(stmt, ast.For) and any(isinstance(sub, ast.Assert) for sub in ast.walk(stmt)):
            self._unroll(stmt)
            return
        if any(isinstance(sub, ast.Assert) for sub in ast.walk(stmt)):
            raise _Opaque(f"an assert inside a {type(stmt).__name__} statement")
        if isinstance(stmt, ast.Import) and all(a.name == "math" for a in stmt.names):
            self.math_names.update(a.asname or a.name for a in stmt.names)
        elif isinstance(stmt, ast.ImportFrom) and stmt.module == "math" and all(
                a.name in MATH_FUNCTIONS for a in stmt.names):
            self.math_imports.update({a.asname or a.name: a.name for a in stmt.names})
        # Any other statement runs inside, in order: setup (imports, helper defs, assignments from calls).
        loads, binds, source = _loaded_names(stmt), _bound_names(stmt), ast.unparse(stmt)
        if self._program_free(stmt):
            self._binds(loads, self.clean)
            self.clean.append(_Step("exec", source, loads, binds, True))
            self._binds(loads, self.program)
            self.program.append(_Step("exec", source, loads, binds, True))
            for name in binds:
                self.judge_values.pop(name, None)
            self.clean_defined |= binds
        else:
            self._binds(loads, self.program)
            self.program.append(_Step("exec", source, loads, binds))
            self._taint(loads | binds)

    def _unroll(self, stmt: ast.For) -> None:
        """``for x in <constant>: <asserts>``: the body once per item, x bound by the judge."""
        if stmt.orelse or any(isinstance(s, (ast.Break, ast.Continue, ast.Return, ast.Yield)) for s in ast.walk(stmt)):
            raise _Opaque("an assert inside a loop with break/continue/else")
        items = self.constant(stmt.iter)
        if items is _NOT_CONSTANT:
            raise _Opaque("an assert inside a loop over values the judge does not know")
        items = list(items)
        if len(items) > 1000:
            raise _Opaque("an assert inside a loop of more than 1000 rounds")
        for item in items:
            self._assign_target(stmt.target, item)
            for inner in stmt.body:
                self.statement(inner)

    def _assign_target(self, target: ast.expr, value: Any) -> None:
        if isinstance(target, ast.Name):
            self.judge_values[target.id] = value
            self.clean_defined.discard(target.id)
            return
        if isinstance(target, (ast.Tuple, ast.List)) and not any(isinstance(e, ast.Starred) for e in target.elts):
            values = list(value)
            if len(values) != len(target.elts):
                raise _Opaque("a loop target that does not match its items")
            for element, item in zip(target.elts, values):
                self._assign_target(element, item)
            return
        raise _Opaque("a loop target the judge cannot bind")

    def finish(self) -> Plan:
        """Keep in the program run only the test code it needs (a reference function used only by clean-run checks
        stays out of the program's reach), then fill the plan's step lists."""
        needed: set[str] = set()
        keep = [False] * len(self.program)
        changed = True
        while changed:
            changed = False
            for i, step in enumerate(self.program):
                wanted = (step.kind == "eval" or not step.program_free or not step.binds or step.binds & needed)
                if wanted and not keep[i]:
                    keep[i] = True
                    needed |= step.loads
                    changed = True
        self.plan.program_steps = [["exec" if s.kind == "bind" else s.kind, s.source]
                                   for s, k in zip(self.program, keep) if k]
        self.plan.clean_steps = [["exec" if s.kind == "bind" else s.kind, s.source] for s in self.clean]
        self.plan.math_imports = dict(self.math_imports)
        return self.plan


_NOT_CONSTANT = object()


class _Opaque(Exception):
    pass


def _inline_humaneval(statements: list[ast.stmt]) -> list[ast.stmt]:
    """``def check(candidate): <asserts>`` + ``check(f)``: the body with `candidate` replaced by `f`."""
    if not statements or not isinstance(statements[-1], ast.Expr):
        return statements
    call = statements[-1].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and len(call.args) == 1
            and not call.keywords and isinstance(call.args[0], ast.Name)):
        return statements
    defs = [s for s in statements[:-1] if isinstance(s, ast.FunctionDef) and s.name == call.func.id]
    if len(defs) != 1 or len(defs[0].args.args) != 1 or defs[0].args.vararg or defs[0].args.kwarg:
        return statements
    check, target = defs[0], call.args[0].id
    param = check.args.args[0].arg

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.Name:
            return ast.Name(id=target, ctx=node.ctx) if node.id == param else node

    body = [ast.fix_missing_locations(Rename().visit(s)) for s in check.body]
    return [s for s in statements[:-1] if s is not check] + body


def plan_snippet(snippet: str) -> Plan:
    """Split one test snippet (see the module docstring). Never raises: an unsplittable snippet is opaque."""
    try:
        tree = ast.parse(snippet)
    except (SyntaxError, ValueError) as exc:
        return Plan(opaque=f"the test does not parse: {exc}")
    statements = _inline_humaneval(list(tree.body))
    snippet_names = set().union(*[_bound_names(s) for s in statements]) if statements else set()
    splitter = _Splitter(snippet_names)
    try:
        for stmt in statements:
            splitter.statement(stmt)
    except (_Opaque, JudgeError, RecursionError) as exc:
        return Plan(opaque=str(exc) or type(exc).__name__)
    if not splitter.plan.checks:
        return Plan(opaque="no assert at the top level")
    return splitter.finish()

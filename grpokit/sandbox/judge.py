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
"""

from __future__ import annotations

import ast
import builtins
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

_HARNESS_SOURCE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_harness.py"),
                       encoding="utf-8").read()

# Pure functions the judge applies itself to plain values (never to the program's objects).
JUDGE_FUNCTIONS: dict[str, Any] = {
    name: getattr(builtins, name)
    for name in ("abs", "len", "round", "min", "max", "sum", "sorted", "set", "frozenset", "tuple", "list",
                 "dict", "int", "float", "str", "bool", "all", "any", "repr", "divmod", "pow", "range",
                 "reversed", "enumerate", "zip", "complex", "bytes", "chr", "ord", "hash", "type", "isinstance")
}
# Names of plain types the judge resolves itself (`type(f(x)) == int`, `isinstance(f(x), (int, float))`): the
# program's own classes, metaclasses or __class__ properties never take part in the check.
PLAIN_TYPES = {t.__name__: t for t in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset)}
MATH_FUNCTIONS = {name: getattr(math, name) for name in (
    "isclose", "isnan", "isinf", "isfinite", "fabs", "floor", "ceil", "sqrt", "trunc", "gcd", "lcm", "comb",
    "perm", "factorial", "log", "log2", "log10", "exp", "prod", "fsum", "dist", "hypot")}
MATH_CONSTANTS = {name: getattr(math, name) for name in ("pi", "e", "tau", "inf", "nan")}
_SIZE_LIMIT = 10**6  # elements or digits the judge builds itself from program values before giving up
_NO_JUDGE_FUNCTIONS = frozenset({"pow", "factorial", "comb", "perm"})  # size-checked below


class JudgeError(Exception):
    """A check could not be evaluated (a program value of the wrong kind, a result too large): the check fails."""


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


def harness_program(code: str, steps: list[list[str]], keep_going: bool) -> str:
    """The program the sandbox runs: the harness, then a call with the payload (the solution travels as data)."""
    payload = json.dumps({"code": code, "steps": steps, "keep_going": keep_going})
    return f"{_HARNESS_SOURCE}\n\nrun(__import__('json').loads({payload!r}))\n"


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


def _literal_source(value: Any) -> str:
    """Source text that rebuilds a plain value exactly (nan, inf and empty sets included)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "float('nan')"
        if math.isinf(value):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    if isinstance(value, complex):
        return f"complex({_literal_source(value.real)}, {_literal_source(value.imag)})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_literal_source(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, (set, frozenset)):
        inner = ", ".join(_literal_source(v) for v in value)
        body = f"{{{inner}}}" if value else "set()"
        return body if isinstance(value, set) else f"frozenset({body if value else ''})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal_source(k)}: {_literal_source(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    raise JudgeError(f"cannot write a {type(value).__name__} as a literal")


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


# --- the judge's own evaluation ----------------------------------------------------------------------------------


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3
    try:
        return len(value)
    except TypeError:
        return 1


def _guard_binop(op: ast.operator, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be huge (a program can return large numbers on purpose)."""
    if isinstance(op, ast.Pow) and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right > 0 and right * max(abs(left).bit_length(), 1) > 4 * _SIZE_LIMIT:
            raise JudgeError("a power too large to compute")
    if isinstance(op, ast.LShift) and isinstance(right, int) and right > 4 * _SIZE_LIMIT:
        raise JudgeError("a shift too large to compute")
    if isinstance(op, ast.Mult):
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > _SIZE_LIMIT:
                raise JudgeError("a repetition too large to build")


_BINOPS = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b, ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
    ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b, ast.BitAnd: lambda a, b: a & b,
}
_CMPOPS = {
    ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b, ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_UNARY = {ast.Not: lambda a: not a, ast.USub: lambda a: -a, ast.UAdd: lambda a: +a, ast.Invert: lambda a: ~a}


def evaluate(node: ast.expr, env: dict[str, Any], math_imports: dict[str, str] | None = None) -> Any:
    """Evaluate a judge-side expression over plain values. Raises JudgeError for anything it cannot do."""
    try:
        return _eval(node, env, math_imports or {})
    except JudgeError:
        raise
    except (ArithmeticError, TypeError, ValueError, KeyError, IndexError, RecursionError, MemoryError) as exc:
        raise JudgeError(f"{type(exc).__name__}: {exc}") from None


def _eval(node: ast.expr, env: dict[str, Any], math_imports: dict[str, str]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise JudgeError(f"unknown name {node.id!r}")
        value = env[node.id]
        if isinstance(value, _Raised):
            raise JudgeError(f"a value it needs raised {value.message}")
        if value is _MISSING:
            raise JudgeError("a value it needs was not reached")
        return value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_eval(e, env, math_imports) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {_eval(k, env, math_imports): _eval(v, env, math_imports) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand, env, math_imports))
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left, env, math_imports), _eval(node.right, env, math_imports)
        _guard_binop(node.op, left, right)
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.BoolOp):
        value = None
        for part in node.values:
            value = _eval(part, env, math_imports)
            if isinstance(node.op, ast.And) and not value or isinstance(node.op, ast.Or) and value:
                return value
        return value
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env, math_imports)
        for op, comparator in zip(node.ops, node.comparators):
            right = _eval(comparator, env, math_imports)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.IfExp):
        return _eval(node.body if _eval(node.test, env, math_imports) else node.orelse, env, math_imports)
    if isinstance(node, ast.Subscript):
        return _eval(node.value, env, math_imports)[_eval(node.slice, env, math_imports)]
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else _eval(p, env, math_imports) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        func = _function(node.func, math_imports)
        args = [_eval(a, env, math_imports) for a in node.args]
        kwargs = {k.arg: _eval(k.value, env, math_imports) for k in node.keywords}
        for value in list(args) + list(kwargs.values()):
            if _size(value) > _SIZE_LIMIT:
                raise JudgeError("an argument too large")
        if func in (range,) and len(range(*args)) > _SIZE_LIMIT:
            raise JudgeError("a range too large")
        if func in (pow, math.factorial, math.comb, math.perm) and any(
                isinstance(a, int) and abs(a) > 10**5 for a in args):
            raise JudgeError("a number too large for the judge")
        result = func(*args, **kwargs)
        if isinstance(result, (range, reversed, enumerate, zip)) or type(result).__name__.endswith("iterator"):
            result = list(result) if func is not range else result
        return result
    raise JudgeError(f"cannot evaluate a {type(node).__name__}")


def _function(node: ast.expr, math_imports: dict[str, str]) -> Any:
    if isinstance(node, ast.Name):
        if node.id in math_imports:
            return MATH_FUNCTIONS[math_imports[node.id]]
        if node.id in JUDGE_FUNCTIONS:
            return JUDGE_FUNCTIONS[node.id]
    if isinstance(node, ast.Attribute) and node.attr in MATH_FUNCTIONS:
        return MATH_FUNCTIONS[node.attr]
    raise JudgeError(f"cannot call {ast.unparse(node)}")


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
            return {"L": list, "T": tuple, "E": set, "Z": frozenset}[tag](items)
        if tag == "D" and len(rest) == 1 and isinstance(rest[0], list):
            pairs = rest[0]
            if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
                raise _Bad("malformed dict")
            return {decode_value(k, depth + 1): decode_value(v, depth + 1) for k, v in pairs}
    except (ValueError, TypeError, OverflowError) as exc:  # bad hex, unhashable key or element
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


def _substituted(expr: ast.expr, plan: Plan, env: dict[str, Any]) -> ast.expr:
    """`expr` with every slot replaced by its value written as a literal (deferred calls, recursively)."""

    class Fill(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.expr:
            if node.id not in plan.slots:
                return node
            where, payload = plan.slots[node.id]
            if where == "deferred":
                return Fill().visit(_copy(payload))
            value = env[node.id]
            if isinstance(value, _Raised):
                raise _Unavailable(f"a value it needs raised {value.message}")
            if value is _MISSING:
                raise _Unavailable("a value it needs was not reached")
            return ast.parse(_literal_source(value), mode="eval").body

    return ast.fix_missing_locations(Fill().visit(_copy(expr)))


def _copy(node: ast.expr) -> ast.expr:
    return ast.parse(ast.unparse(node), mode="eval").body


def deferred_program(plan: Plan, program: RunValues, clean: RunValues | None) -> tuple[str | None, dict[str, Any]]:
    """The second, clean run for calls of test functions on the program's values (`assert close(f(2), 4.0)`):
    the harness program (None when nothing is left to run) and, per deferred slot, the index of its value in that
    run or why it has none. Only after the program run (and the first clean run) reported."""
    if not plan.deferred or program.error is not None:
        return None, {}
    env = _phase_one_env(plan, program, clean)
    steps = [step for step in plan.clean_steps if step[0] == "exec"]
    where: dict[str, Any] = {}
    count = 0
    for name in plan.deferred:
        try:
            source = ast.unparse(_substituted(ast.Name(id=name, ctx=ast.Load()), plan, env))
        except (_Unavailable, JudgeError) as exc:
            where[name] = _Raised(str(exc))
            continue
        steps.append(["eval", source])
        where[name] = count
        count += 1
    return (harness_program("", steps, keep_going=True) if count else None), where


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


class _Missing:
    pass


_MISSING = _Missing()


class _Raised:
    def __init__(self, message: str) -> None:
        self.message = message

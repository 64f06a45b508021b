"""The judge's own evaluation: judge-side expressions over plain values, and plain values written as literals.

`evaluate` applies only the operators, pure built-ins and math functions listed here, with size guards (a program
can return huge values on purpose); anything else is a JudgeError, and the check fails. `_literal_source` writes
a plain value back as source, for test code that runs on the program's values in a clean run.
"""

from __future__ import annotations

import ast
import builtins
import math
from typing import Any, Iterable

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
_MAX_SHARED_HASH = 16  # distinct elements of one set or dict of program values that may share a hash value
_WORK_LIMIT = 10**7  # steps (digit products, item copies) of one judge operation whose time is quadratic


class JudgeError(Exception):
    """A check could not be evaluated (a program value of the wrong kind, a result too large): the check fails."""


def check_hashing(items: Iterable[Any]) -> None:
    """Refuse (JudgeError) elements of which more than _MAX_SHARED_HASH distinct ones share a hash value, before a
    set or dict is built of them: each such element is compared with every earlier one of its hash, so a program
    that returns crafted values (33,000 ints equal modulo 2**61 - 1, tuples or frozensets whose hashes combine to
    one value) would cost the trainer quadratic time. Python's hashes of str and bytes are salted per process, so
    only numbers and containers of them can be crafted; real answers never come near the limit. At most
    _MAX_SHARED_HASH comparisons per element."""
    groups: dict[int, list[Any]] = {}
    for item in items:
        group = groups.setdefault(hash(item), [])
        if any(other is item or other == item for other in group):
            continue  # a repeat: a set keeps one
        if len(group) == _MAX_SHARED_HASH:
            raise JudgeError(f"more than {_MAX_SHARED_HASH} distinct elements share one hash value (crafted to "
                             "make building a set or dict of them take quadratic time)")
        group.append(item)


def _hashed_by(func: Any, arg: Any) -> Iterable[Any]:
    """What `func(arg)` hashes, for func in set, frozenset, dict: the elements, or the keys of (key, value) pairs."""
    if func is dict and not isinstance(arg, dict):
        return [item[0] for item in arg if isinstance(item, (list, tuple)) and len(item) == 2]
    return arg


def _literal_source(value: Any) -> str:
    """Source text that rebuilds a plain value exactly (nan, inf and empty sets included). Large ints are written
    in hex: Python refuses to write an int of more than 4,300 decimal digits (and to read one back)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**64:
        return hex(value)
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
    if isinstance(op, (ast.FloorDiv, ast.Mod)):
        _guard_quadratic(divmod, [left, right])


def _bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) else 64


def _guard_quadratic(func: Any, args: list[Any]) -> None:
    """Refuse a call whose time grows with the square of what the program returned (a program can return a
    4-million-bit int or 100,000 items within the output cap): dividing or taking the gcd of two huge ints,
    a product of many ints (each step multiplies the growing result), a sum of lists (each step copies it)."""
    digit = 30  # bits per digit of Python's ints: one step multiplies two digits
    if func in (divmod, math.gcd, math.lcm) and len(args) >= 2 and all(isinstance(a, int) for a in args):
        steps = (_bits(args[0]) // digit + 1) * (_bits(args[1]) // digit + 1)
    elif func is math.prod and args:
        items = list(args[0])
        steps = len(items) * sum(_bits(item) // digit + 1 for item in items)
    elif func is sum and len(args) == 2 and isinstance(args[1], (list, tuple)):
        items = list(args[0])
        steps = len(items) * sum(_size(item) for item in items)
    else:
        return
    if steps > _WORK_LIMIT:
        raise JudgeError(f"{getattr(func, '__name__', func)} of values this large takes too long for the judge")


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
        return _lookup(node, env)
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
        return _call(func, args, kwargs)
    raise JudgeError(f"cannot evaluate a {type(node).__name__}")


def _lookup(node: ast.Name, env: dict[str, Any]) -> Any:
    """A name's plain value; JudgeError for a name the judge does not know, or a value that raised or was not
    reached."""
    if node.id not in env:
        raise JudgeError(f"unknown name {node.id!r}")
    value = env[node.id]
    if isinstance(value, _Raised):
        raise JudgeError(f"a value it needs raised {value.message}")
    if value is _MISSING:
        raise JudgeError("a value it needs was not reached")
    return value


def _call(func: Any, args: list[Any], kwargs: dict[str, Any]) -> Any:
    """func(*args, **kwargs) for a function of the lists above, after the size guards (JudgeError when the call
    would build or take too much); an iterator it returns is made a list (a range stays a range)."""
    for value in list(args) + list(kwargs.values()):
        if _size(value) > _SIZE_LIMIT:
            raise JudgeError("an argument too large")
    if func in (set, frozenset, dict) and args:
        check_hashing(_hashed_by(func, args[0]))
    _guard_quadratic(func, args)
    if func in (range,) and len(range(*args)) > _SIZE_LIMIT:
        raise JudgeError("a range too large")
    if func in (pow, math.factorial, math.comb, math.perm) and any(
            isinstance(a, int) and abs(a) > 10**5 for a in args):
        raise JudgeError("a number too large for the judge")
    result = func(*args, **kwargs)
    if isinstance(result, (range, reversed, enumerate, zip)) or type(result).__name__.endswith("iterator"):
        result = list(result) if func is not range else result
    return result


def _function(node: ast.expr, math_imports: dict[str, str]) -> Any:
    if isinstance(node, ast.Name):
        if node.id in math_imports:
            return MATH_FUNCTIONS[math_imports[node.id]]
        if node.id in JUDGE_FUNCTIONS:
            return JUDGE_FUNCTIONS[node.id]
    if isinstance(node, ast.Attribute) and node.attr in MATH_FUNCTIONS:
        return MATH_FUNCTIONS[node.attr]
    raise JudgeError(f"cannot call {ast.unparse(node)}")


class _Missing:
    pass


_MISSING = _Missing()


class _Raised:
    def __init__(self, message: str) -> None:
        self.message = message

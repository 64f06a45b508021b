"""Built-in tools: "calculator" (exact arithmetic, no eval) and "python" (model-written code, in the sandbox).

The calculator bounds its work before doing it: an expression of at most MAX_EXPRESSION_CHARS characters and
MAX_NODES nodes, and no integer (the result, or any value on the way) over MAX_DIGITS digits, refused from the
operands' sizes before a product or a power is computed; so any expression it accepts takes milliseconds.
"""

from __future__ import annotations

import ast
import math
import operator

from grpokit.tools.toolbox import TOOLS

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # a result or intermediate value longer than this is refused (2**10**9 would take the machine)
MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))
MAX_EXPRESSION_CHARS = 2000
MAX_NODES = 500  # with MAX_BITS, bounds the work of any accepted expression: a few ms


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if _result_bits(node.op, left, right) > MAX_BITS + 1:
            raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


def _result_bits(op: ast.operator, left: int | float, right: int | float) -> int:
    """An upper bound on the size in bits of an integer `left op right`, known before computing it, for the two
    operations whose result outgrows their operands (0 for the others: _bounded checks their result)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0  # a float result cannot grow past float's range (it raises OverflowError)
    if isinstance(op, ast.Mult):
        return left.bit_length() + right.bit_length()
    if isinstance(op, ast.Pow) and right > 0 and abs(left) > 1:
        return (left.bit_length() - 1) * right + 1
    return 0


def _bounded(value: int | float) -> int | float:
    """The value, or ValueError when an integer has more than MAX_DIGITS digits (checked by its bits)."""
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError(f"the result would have more than {MAX_DIGITS} digits")
    return value


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * 45".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"the expression has more than {MAX_NODES} numbers and operators")
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)
    return str(value)


@TOOLS.register("python")
def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: The program; print what you want to see. It runs alone, without network, for at most 10 seconds.
    """
    from grpokit.sandbox import run_python

    result = run_python(code)
    if result.status == "infra_error":
        raise RuntimeError("the sandbox could not run the program (a problem of the machine, not of the code)")
    if result.ok:
        return result.stdout
    tail = result.stderr.strip().splitlines()[-3:]
    return f"{result.stdout}[{result.status}] " + " / ".join(tail)

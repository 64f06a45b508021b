"""Built-in tools: "calculator" (exact arithmetic, no eval) and "python" (model-written code, in the sandbox)."""

from __future__ import annotations

import ast
import operator

from grpokit.tools.toolbox import TOOLS

_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 1000  # a result longer than this is refused (2**10**9 would take the machine)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) * max(1, len(str(abs(int(left))))) > MAX_DIGITS:
            raise ValueError("the result would be too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {ast.unparse(node)!r}")


@TOOLS.register("calculator")
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "(12 + 3) * 45".
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
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

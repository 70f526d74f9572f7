"""Safe calculator for the model's tool use: never ``eval``/``exec`` of model text.

The expression is parsed with ``ast.parse(mode="eval")`` and walked over a whitelist of nodes:
int/float literals, + - * / // % **, unary +/-, parentheses, and on string literals only
``len("...")``, ``"...".count("x")``, ``"...".upper()``, ``"...".lower()``. Everything else
(names, other attributes or calls, subscripts, comprehensions, lambdas, ...) is rejected.

Usage::

    from chatpipe.inference.calculator import evaluate, explain
    evaluate("2+3")            # "5"
    evaluate("__import__('os')")  # None
    explain("1/0")             # (None, "division by zero")
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_EXPR_LEN = 200
MAX_MAGNITUDE = 10**30  # bound on every number, intermediate or final
MAX_EXPONENT = 100
STRING_METHODS = {"count": 1, "upper": 0, "lower": 0}  # method -> number of positional args

_BINOPS: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}

Value = int | float | str


class Rejected(Exception):
    """An expression the calculator refuses; the message is the reason."""


def _number(v: Value) -> int | float:
    # bool is an int subclass; True+True is not arithmetic we want to support
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Rejected(f"arithmetic needs numbers, got {type(v).__name__}")
    return v


def _bounded(v: int | float) -> int | float:
    if isinstance(v, complex):
        raise Rejected("complex result")
    if isinstance(v, float) and not math.isfinite(v):
        raise Rejected("result is not finite")
    if abs(v) > MAX_MAGNITUDE:
        raise Rejected("result too large")
    return v


def _power(base: int | float, exp: int | float) -> int | float:
    if abs(exp) > MAX_EXPONENT:
        raise Rejected(f"exponent too large (|exponent| > {MAX_EXPONENT})")
    # estimate the size before computing so e.g. (10**30)**100 never materialises
    if abs(base) > 1 and exp > 0 and exp * math.log10(abs(base)) > 31:
        raise Rejected("result too large")
    if base == 0 and exp < 0:
        raise Rejected("division by zero")
    return base**exp


def _binop(op: ast.operator, left: Value, right: Value) -> Value:
    fn = _BINOPS.get(type(op))
    if fn is None:
        raise Rejected(f"operator {type(op).__name__} not allowed")
    a, b = _number(left), _number(right)
    if isinstance(op, ast.Pow):
        return _bounded(_power(a, b))
    if isinstance(op, (ast.Div, ast.FloorDiv, ast.Mod)) and b == 0:
        raise Rejected("division by zero")
    return _bounded(fn(a, b))


def _call(node: ast.Call) -> Value:
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise Rejected("keyword or starred arguments not allowed")
    args = [_eval(a) for a in node.args]
    if isinstance(node.func, ast.Name) and node.func.id == "len":
        if len(args) != 1 or not isinstance(args[0], str):
            raise Rejected("len() takes one string")
        return len(args[0])
    func = node.func
    if (
        isinstance(func, ast.Attribute)
        and func.attr in STRING_METHODS
        and isinstance(func.value, ast.Constant)
        and isinstance(func.value.value, str)
    ):
        if len(args) != STRING_METHODS[func.attr] or not all(isinstance(a, str) for a in args):
            raise Rejected(f".{func.attr}() takes {STRING_METHODS[func.attr]} string argument(s)")
        return getattr(func.value.value, func.attr)(*args)
    raise Rejected("only len(), and .count()/.upper()/.lower() on a string literal, may be called")


def _eval(node: ast.AST) -> Value:
    if isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, str):
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise Rejected(f"literal {v!r} not allowed")
        return _bounded(v)
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _number(_eval(node.operand))
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Call):
        return _call(node)
    raise Rejected(f"{type(node).__name__} not allowed")


def _format(v: Value) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, int):
        return str(v)
    text = f"{round(v, 6):.6f}".rstrip("0").rstrip(".")  # at most 6 decimals, no trailing zeros
    return "0" if text in ("-0", "") else text


def explain(expr: str) -> tuple[str | None, str]:
    """Evaluate ``expr``; return (result, "ok") or (None, reason it was rejected)."""
    if not isinstance(expr, str):
        return None, "expression must be a string"
    expr = expr.strip()
    if not expr:
        return None, "empty expression"
    if len(expr) > MAX_EXPR_LEN:
        return None, f"expression too long ({len(expr)} > {MAX_EXPR_LEN} chars)"
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None, "syntax error"
    try:
        return _format(_eval(tree.body)), "ok"
    except Rejected as e:
        return None, str(e)
    except (ArithmeticError, RecursionError, ValueError) as e:  # e.g. float overflow
        return None, f"arithmetic error: {type(e).__name__}"


def evaluate(expr: str) -> str | None:
    """The result as a string (ints plain, floats to <= 6 decimals), or None when rejected."""
    return explain(expr)[0]

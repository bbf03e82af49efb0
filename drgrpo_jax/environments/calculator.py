"""The built-in calculator: exact arithmetic on an expression, read with `ast` (never `eval`), every size bounded.

Integers stay exact and `/` gives an exact fraction, printed as an integer when it is one and as a decimal
otherwise. Sizes are checked before each operation, so `9**9**9` or a 10,000-digit product is refused at once
instead of computed.
"""

from __future__ import annotations

import ast
import fractions
import operator
from collections.abc import Callable

from drgrpo_jax.errors import CalculatorError

__all__ = ["calculate", "calculator"]

MAX_EXPRESSION_CHARS = 500
MAX_DIGITS = 200  # of any operand or result (numerator and denominator alike)
MAX_EXPONENT = 1000


Number = fractions.Fraction

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}


def _digits(x: Number) -> int:
    return max(len(str(abs(x.numerator))), len(str(x.denominator)))


def _bounded(x: Number) -> Number:
    if _digits(x) > MAX_DIGITS:
        raise CalculatorError(f"a value has more than {MAX_DIGITS} digits")
    return x


def _power(base: Number, exponent: Number) -> Number:
    if exponent.denominator != 1:
        raise CalculatorError("only whole exponents")
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent beyond {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    # The result's size from the operands' bit lengths, before computing it: (bits - 1) * |e| bounds it below.
    bits = max(abs(base.numerator).bit_length(), base.denominator.bit_length())
    if (bits - 1) * abs(int(exponent)) * 0.30103 > MAX_DIGITS:
        raise CalculatorError(f"the result would have more than {MAX_DIGITS} digits")
    return base ** int(exponent)


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(Number(node.value))
    if isinstance(node, ast.Constant) and isinstance(node.value, float):
        if node.value != node.value or abs(node.value) == float("inf"):
            raise CalculatorError("numbers must be finite")
        return _bounded(Number(repr(node.value)))  # the decimal as written: 0.1 is 1/10, not its binary neighbour
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not arithmetic")
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(op(left, right))
    raise CalculatorError(f"{ast.unparse(node)[:40]!r} is not a number or + - * / // % ** of numbers")


def _format(x: Number) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return f"{float(x):.12g}"


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, as text; CalculatorError saying why it cannot be computed."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"cannot read the expression: {error.msg}") from None
    try:
        return _format(_evaluate(tree))
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (+ - * / // % ** and parentheses), e.g. "(17 * 23) - 4"."""
    return calculate(expression)

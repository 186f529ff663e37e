"""A safe calculator for model-written arithmetic: no `eval`, exact rationals, hard limits.

`calculate("12 * (3 + 4) / 2")` parses the text with Python's `ast` in expression mode and walks
only the nodes of arithmetic (numbers, + - * / // % **, unary signs, parentheses); anything else
(names, calls, attributes, strings, comparisons) is refused. Values are `fractions.Fraction`, so
`1/3*3` is exactly 1. Limits keep hostile input cheap: text length, nesting depth, the size of
every number and intermediate result, and the exponent of `**`. Every refusal raises
`CalculatorError` with a short reason the environment shows the policy.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

MAX_CHARS = 200
MAX_DEPTH = 24
MAX_ABS = 10 ** 15  # numbers and intermediate results
MAX_DIGITS = 16  # of a literal
MAX_EXPONENT = 12
MAX_DENOMINATOR = 10 ** 9


class CalculatorError(ValueError):
  """The text is not an expression the calculator evaluates (the reason is the message)."""


_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: None, ast.FloorDiv: None, ast.Mod: None,
           ast.Pow: None}


def _check(v: Fraction) -> Fraction:
  if abs(v) > MAX_ABS:
    raise CalculatorError("number too large")
  if v.denominator > MAX_DENOMINATOR:
    raise CalculatorError("result too precise")
  return v


def _eval(node, depth: int) -> Fraction:
  if depth > MAX_DEPTH:
    raise CalculatorError("expression nested too deeply")
  if isinstance(node, ast.Expression):
    return _eval(node.body, depth + 1)
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    if isinstance(node.value, float) and not math.isfinite(node.value):
      # A literal past float range (`1e999`) parses as inf, which no Fraction holds.
      raise CalculatorError("not a number" if math.isnan(node.value) else "number too large")
    return _check(Fraction(node.value) if isinstance(node.value, int)
                  else Fraction(repr(node.value)))
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    v = _eval(node.operand, depth + 1)
    return -v if isinstance(node.op, ast.USub) else v
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    a, b = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
    op = type(node.op)
    if op in (ast.Div, ast.FloorDiv, ast.Mod) and b == 0:
      raise CalculatorError("division by zero")
    if op is ast.Div:
      return _check(a / b)
    if op is ast.FloorDiv:
      return _check(Fraction(a // b))
    if op is ast.Mod:
      return _check(a % b)
    if op is ast.Pow:
      if b.denominator != 1 or abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent must be a whole number up to {MAX_EXPONENT}")
      if a == 0 and b < 0:
        raise CalculatorError("division by zero")
      return _check(a ** int(b))
    return _check(_BINOPS[op](a, b))
  raise CalculatorError("only numbers and + - * / // % ** ( ) are allowed")


def calculate(text: str) -> Fraction:
  """The exact value of arithmetic `text` (see the module docstring); CalculatorError if refused.

  >>> calculate("12 * (3 + 4) / 2")
  Fraction(42, 1)
  """
  if not isinstance(text, str):
    raise CalculatorError("expected text")
  text = text.strip()
  if not text:
    raise CalculatorError("empty expression")
  if len(text) > MAX_CHARS:
    raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
  if text.count("(") > MAX_DEPTH:
    raise CalculatorError("expression nested too deeply")
  for tok in text.replace("(", " ").replace(")", " ").split():
    digits = sum(ch.isdigit() for ch in tok)
    if digits > MAX_DIGITS:
      raise CalculatorError("number too large")
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalculatorError("not an arithmetic expression") from None
  return _eval(tree, 0)


def format_value(v: Fraction) -> str:
  """An integer as digits, anything else as a decimal with up to 6 places ("2.5", "0.333333")."""
  if v.denominator == 1:
    return str(v.numerator)
  s = f"{float(v):.6f}".rstrip("0").rstrip(".")
  return s if s not in ("-0", "") else "0"


__all__ = ["CalculatorError", "calculate", "format_value"]

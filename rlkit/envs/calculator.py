"""The calculator tool: the model writes `<calc>12*7+3</calc>`, the environment answers `<result>87</result>`.

Expressions are evaluated by a small recursive-descent parser over exact fractions (numbers, + - * /,
unary minus, parentheses): no `eval`, no names, no attribute access, no powers, bounded input length
and magnitude, so a policy cannot make the trainer run arbitrary code or huge computations.

    expr   := term (('+' | '-') term)*
    term   := factor (('*' | '/') factor)*
    factor := ('+' | '-') factor | NUMBER | '(' expr ')'
"""

from __future__ import annotations

import re
from fractions import Fraction

from rlkit.envs.base import ENVIRONMENTS, Environment

MAX_CHARS = 200
MAX_ABS = Fraction(10) ** 30
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?|\.\d+)|(.))")
OPEN, CLOSE = "<calc>", "</calc>"
ROLES = ("user", "tool", "system")
"""The chat roles the result message may take (`role`); the chat template must know the one chosen."""


class CalcError(ValueError):
    """An expression the calculator rejects (the message is shown to the model)."""


def _tokens(expr: str) -> list[str]:
    out = []
    for number, op in _TOKEN.findall(expr):
        if number:
            out.append(number)
        elif op.strip():
            if op not in "+-*/()":
                raise CalcError(f"unexpected character {op!r}")
            out.append(op)
    return out


def evaluate(expr: str) -> Fraction:
    """The exact value of an arithmetic expression; raises CalcError on anything else."""
    expr = expr.replace(",", "").replace("×", "*").replace("x", "*")
    if len(expr) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    toks = _tokens(expr)
    if not toks:
        raise CalcError("empty expression")
    pos = 0

    def peek():
        return toks[pos] if pos < len(toks) else None

    def take():
        nonlocal pos
        pos += 1
        return toks[pos - 1]

    def check(v: Fraction) -> Fraction:
        if abs(v) > MAX_ABS:
            raise CalcError("number too large")
        return v

    def expr_():
        v = term()
        while peek() in ("+", "-"):
            v = check(v + term() if take() == "+" else v - term())
        return v

    def term():
        v = factor()
        while peek() in ("*", "/"):
            op, rhs = take(), factor()
            if op == "/" and rhs == 0:
                raise CalcError("division by zero")
            v = check(v * rhs if op == "*" else v / rhs)
        return v

    def factor():
        t = peek()
        if t in ("+", "-"):
            take()
            return factor() if t == "+" else -factor()
        if t == "(":
            take()
            v = expr_()
            if take_if(")") is None:
                raise CalcError("missing ')'")
            return v
        if t is None or t in "+-*/()":
            raise CalcError(f"expected a number, got {t or 'the end'!r}")
        return check(Fraction(take()))

    def take_if(t):
        return take() if peek() == t else None

    value = expr_()
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]!r}")
    return value


def last_call(text: str) -> str | None:
    """The expression of the last `<calc>EXPR</calc>` of `text` (None without one), as the lazy pattern
    `<calc>(.*?)</calc>` would find it, but in time linear in the text: a regex scan is quadratic on a turn
    full of unclosed `<calc>` tags (48 KB took 3.7 s, 1 MB over a minute, inside the trainer)."""
    call, pos = None, 0
    while (start := text.find(OPEN, pos)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            break
        call, pos = text[start + len(OPEN) : end], end + len(CLOSE)
    return call


def format_number(v: Fraction) -> str:
    """An integer as digits; anything else as a decimal with up to 6 places (trailing zeros removed)."""
    if v.denominator == 1:
        return str(v.numerator)
    return f"{float(v):.6f}".rstrip("0").rstrip(".")


# Worked exchanges for `Calculator(examples=k)`: (question, the call that answers it).
EXAMPLES = (("What is 12 * 34?", "12 * 34"), ("What is 250 * 19?", "250 * 19"))


@ENVIRONMENTS.register("calculator")
class Calculator(Environment):
    """A calculator tool: each model turn ending in `<calc>EXPR</calc>` gets `<result>VALUE</result>`
    back (an error message for a bad expression, as text the model can read); a turn without a call
    ends the episode, whose final answer the reward functions judge."""

    stop = ("</calc>",)

    def __init__(self, role: str = "user", examples: int = 0):
        """`role`: the chat role of the result message (the template must know it). `examples`: worked
        exchanges (question, call, result, answer) shown as earlier chat turns before the question, 0 to
        len(EXAMPLES): a small model that never calls the tool from an instruction alone copies them."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {list(ROLES)}")
        if not 0 <= examples <= len(EXAMPLES):
            raise ValueError(f"examples={examples!r} must be between 0 and {len(EXAMPLES)}")
        self.role = role
        self.examples = examples
        self.tool_calls = 0

    def reset(self, row: dict, messages: list[dict]) -> list[dict]:
        shown = []
        for question, expr in EXAMPLES[: self.examples]:
            shown += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": f"<calc>{expr}</calc>"},
                {"role": self.role, "content": f"<result>{format_number(evaluate(expr))}</result>"},
                {"role": "assistant", "content": f"#### {format_number(evaluate(expr))}"},
            ]
        return messages[:-1] + shown + messages[-1:]  # before the dataset's question

    def step(self, text: str) -> tuple[list[dict] | None, float, bool]:
        call = last_call(text)
        if call is None:
            return None, 0.0, True
        self.tool_calls += 1
        try:
            result = format_number(evaluate(call))
        except CalcError as e:
            result = f"error: {e}"
        return [{"role": self.role, "content": f"<result>{result}</result>"}], 0.0, False

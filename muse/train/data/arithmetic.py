"""Arithmetic conversations: +, -, * of 1-4 digit numbers with a short worked reasoning block.

The reasoning is column arithmetic written out one column per sentence, right to left, so
each step is a single-digit fact a small model can learn and the answer is read off the
written digits:

    37+45:  7+5=12, write 2 carry 1. 3+4+1=8, write 8. So 82.
    82-45:  Compare 82 and 45: 8>4. 82 is not less than 45. 2-5+10=7, write 7 borrow 1.
            8-4-1=3, write 3. So 37.
    37*45:  37*5: 7*5=35, write 5 carry 3. 3*5+3=18, write 18. Gives 185. 37*4: ... Gives
            148, shifted 1480. 185+1480=1665. So 1665.

The answer itself (the reply's content) is the bare number.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from muse.train.data.split import draw_from_split

OPERATIONS = ("add", "sub", "mul")
SYMBOLS = {"add": "+", "sub": "-", "mul": "*"}
MAX_DIGITS = 4
# Multiplication reasoning grows with the product of the digit counts; weighting it a little
# lower keeps its (long) examples from crowding out the rest.
OPERATION_WEIGHTS = {"add": 0.36, "sub": 0.36, "mul": 0.28}
CLOSE_OPERANDS_SHARE = 0.3

QUESTIONS = {
    "add": ["What is {a}+{b}?", "What is {a} + {b}?", "Compute {a} + {b}.", "Calculate {a}+{b}.",
            "{a}+{b}=?", "{a} + {b}", "What's {a} plus {b}?", "Add {a} and {b}.",
            "What is the sum of {a} and {b}?", "Please work out {a}+{b}."],
    "sub": ["What is {a}-{b}?", "What is {a} - {b}?", "Compute {a} - {b}.", "Calculate {a}-{b}.",
            "{a}-{b}=?", "{a} - {b}", "What's {a} minus {b}?", "Subtract {b} from {a}.",
            "What is {b} subtracted from {a}?", "Please work out {a}-{b}."],
    "mul": ["What is {a}*{b}?", "What is {a} * {b}?", "Compute {a} x {b}.", "Calculate {a}*{b}.",
            "{a}*{b}=?", "{a} * {b}", "What's {a} times {b}?", "Multiply {a} by {b}.",
            "What is the product of {a} and {b}?", "Please work out {a}*{b}."],
}


@dataclass(frozen=True)
class Problem:
    operation: str
    a: int
    b: int

    @property
    def answer(self) -> int:
        if self.operation == "add":
            return self.a + self.b
        if self.operation == "sub":
            return self.a - self.b
        return self.a * self.b

    @property
    def key(self) -> str:
        return f"{self.a}{SYMBOLS[self.operation]}{self.b}"

    @property
    def digits(self) -> int:
        """The larger operand's digit count: the category evaluation reports under."""
        return max(len(str(self.a)), len(str(self.b)))


def random_operand(rng: random.Random, digits: int) -> int:
    """A number with exactly `digits` digits (0-9 for one digit)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10 ** digits - 1)


def sample_problem(rng: random.Random, split: str, operation: str | None = None,
                   digits: int | None = None) -> Problem:
    """A problem of `split`. Given `digits`, both operands have that many digits; otherwise
    half the time both share a random count and half the time each has its own."""
    if operation is None:
        operation = rng.choices(OPERATIONS, weights=[OPERATION_WEIGHTS[o] for o in OPERATIONS])[0]

    def draw() -> Problem:
        if digits is not None:
            first = second = digits
        else:
            first = rng.randint(1, MAX_DIGITS)
            second = first if rng.random() < 0.5 else rng.randint(1, MAX_DIGITS)
        a = random_operand(rng, first)
        if operation == "sub" and first == second > 1 and rng.random() < CLOSE_OPERANDS_SHARE:
            # Operands that differ only in the last digit: deciding which is larger is where
            # small models slip, so such pairs are drawn on purpose.
            low = 10 ** (first - 1)
            return Problem(operation, a, min(max(a + rng.randint(-9, 9), low), 10 ** first - 1))
        return Problem(operation, a, random_operand(rng, second))

    return draw_from_split(draw, lambda problem: problem.key, split)


def _digits_low_first(number: int, width: int) -> list[int]:
    return [int(d) for d in reversed(str(number).rjust(width, "0"))]


def _add_columns(a: int, b: int) -> list[str]:
    width = max(len(str(a)), len(str(b)))
    top, bottom = _digits_low_first(a, width), _digits_low_first(b, width)
    steps, carry = [], 0
    for column in range(width):
        total = top[column] + bottom[column] + carry
        expression = f"{top[column]}+{bottom[column]}" + ("+1" if carry else "")
        if column == width - 1:
            steps.append(f"{expression}={total}, write {total}.")
        elif total >= 10:
            steps.append(f"{expression}={total}, write {total - 10} carry 1.")
        else:
            steps.append(f"{expression}={total}, write {total}.")
        carry = int(total >= 10)
    return steps


def _sub_columns(a: int, b: int) -> list[str]:
    """Column subtraction of b from a, where a >= b."""
    width = len(str(a))
    top, bottom = _digits_low_first(a, width), _digits_low_first(b, width)
    steps, borrow = [], 0
    for column in range(width):
        value = top[column] - bottom[column] - borrow
        expression = f"{top[column]}-{bottom[column]}" + ("-1" if borrow else "")
        if value < 0:
            steps.append(f"{expression}+10={value + 10}, write {value + 10} borrow 1.")
        else:
            steps.append(f"{expression}={value}, write {value}.")
        borrow = int(value < 0)
    return steps


def _times_digit_columns(a: int, digit: int) -> list[str]:
    top = _digits_low_first(a, len(str(a)))
    steps, carry = [], 0
    for column, value in enumerate(top):
        product = value * digit + carry
        expression = f"{value}*{digit}" + (f"+{carry}" if carry else "")
        if column == len(top) - 1:
            steps.append(f"{expression}={product}, write {product}.")
        elif product >= 10:
            steps.append(f"{expression}={product}, write {product % 10} carry {product // 10}.")
        else:
            steps.append(f"{expression}={product}, write {product}.")
        carry = product // 10
    return steps


def _mul_steps(a: int, b: int) -> list[str]:
    multiplier = _digits_low_first(b, len(str(b)))
    if len(multiplier) == 1:
        return _times_digit_columns(a, b)
    steps, total = [], 0
    for place, digit in enumerate(multiplier):
        partial = a * digit
        steps.append(f"{a}*{digit}:")
        steps.extend(_times_digit_columns(a, digit))
        if place == 0:
            steps.append(f"Gives {partial}.")
        else:
            steps.append(f"Gives {partial}, shifted {partial * 10 ** place}.")
    for place, digit in enumerate(multiplier):
        shifted = a * digit * 10 ** place
        if place > 0:
            steps.append(f"{total}+{shifted}={total + shifted}.")
        total += shifted
    return steps


def _comparison(a: int, b: int) -> str:
    """Which operand is larger, decided digit by digit from the left.

    Deciding it in one step is where a small model slips on operands that differ only in
    their last digits; written out, each step compares two single digits.
    """
    if len(str(a)) != len(str(b)):
        longer = a if len(str(a)) > len(str(b)) else b
        return f"{longer} has more digits."
    steps = []
    for x, y in zip(str(a), str(b)):
        if x != y:
            steps.append(f"{x}{'>' if x > y else '<'}{y}")
            break
        steps.append(f"{x}={y}")
    return f"Compare {a} and {b}: {', '.join(steps)}."


def worked_reasoning(problem: Problem) -> str:
    """The reasoning block's text (without the <think> tags)."""
    a, b = problem.a, problem.b
    if problem.operation == "add":
        steps = _add_columns(a, b)
    elif problem.operation == "mul":
        steps = _mul_steps(a, b)
    elif a >= b:
        steps = [_comparison(a, b) + f" {a} is not less than {b}."] + _sub_columns(a, b)
    else:
        steps = [_comparison(a, b) + f" {a} is less than {b}, so compute {b}-{a} and negate."]
        steps += _sub_columns(b, a) + [f"{b}-{a}={b - a}."]
    return " ".join(steps + [f"So {problem.answer}."])


def question(problem: Problem, rng: random.Random) -> str:
    template = rng.choice(QUESTIONS[problem.operation])
    return template.format(a=problem.a, b=problem.b)


def exchange(problem: Problem, rng: random.Random) -> list[dict[str, Any]]:
    """A user question and the assistant's worked answer, as chat messages."""
    return [
        {"role": "user", "content": question(problem, rng)},
        {"role": "assistant", "reasoning_content": worked_reasoning(problem),
         "content": str(problem.answer)},
    ]

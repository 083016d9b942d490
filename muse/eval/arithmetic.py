"""Held-out arithmetic: exact-match accuracy per operation and digit count.

Problems come from the held-out split (never trained on) and have both operands of the
category's digit count. Where the held-out split of a category is small (one-digit
problems: about 5 of 100), every held-out problem is used and `count` says how many.
"""

from __future__ import annotations

import random

from muse.eval.generation import ChatPrompt, SectionResult, example, generate_replies, reply_budget
from muse.llm import LLM
from muse.train.data import arithmetic
from muse.train.data.split import HELD_OUT

# Draws per wanted problem before a category is taken to be exhausted.
DRAWS_PER_PROBLEM = 50


def held_out_problems(rng: random.Random, operation: str, digits: int, num: int
                      ) -> list[arithmetic.Problem]:
    """Up to `num` distinct held-out problems with both operands of `digits` digits."""
    found: dict[str, arithmetic.Problem] = {}
    for _ in range(num * DRAWS_PER_PROBLEM):
        problem = arithmetic.sample_problem(rng, HELD_OUT, operation, digits)
        found.setdefault(problem.key, problem)
        if len(found) == num:
            break
    return list(found.values())


def evaluate_arithmetic(llm: LLM, num: int, seed: int, max_tokens: int,
                        max_digits: int = arithmetic.MAX_DIGITS,
                        progress: bool | None = None) -> SectionResult:
    rng = random.Random(f"eval-arithmetic/{seed}")
    cases, prompts = [], []
    for operation in arithmetic.OPERATIONS:
        for digits in range(1, max_digits + 1):
            for problem in held_out_problems(rng, operation, digits, num):
                question, answer = arithmetic.exchange(problem, rng)
                cases.append((operation, digits, problem))
                prompts.append(ChatPrompt([question],
                                          max_tokens=reply_budget(llm, answer, max_tokens)))
    replies = generate_replies(llm, prompts, "arithmetic", progress)
    metrics: dict = {}
    examples = []
    for (operation, digits, problem), prompt, reply in zip(cases, prompts, replies):
        ok = reply.content == str(problem.answer)
        cell = metrics.setdefault(operation, {}).setdefault(str(digits), {"count": 0, "exact": 0})
        cell["count"] += 1
        cell["exact"] += ok
        if len(examples) < 2 * len(arithmetic.OPERATIONS) and digits == 2:
            examples.append(example(prompt, reply, str(problem.answer), ok))
    total = sum(cell["count"] for op in metrics.values() for cell in op.values())
    correct = sum(cell["exact"] for op in metrics.values() for cell in op.values())
    for op in metrics.values():
        for cell in op.values():
            cell["exact"] = cell["exact"] / cell["count"]
    metrics["overall"] = {"count": total, "exact": correct / total if total else 0.0}
    return SectionResult(metrics, replies, examples)

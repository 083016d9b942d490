"""Held-out sorting by list length: exact-match accuracy for lists of 3 to 8 words or numbers.

Training lists hold 3-6 items, so the cells show where the skill holds and where it fades;
the GRPO result of docs/training.md is measured here (6 items).
"""

from __future__ import annotations

import random

from muse.eval.generation import ChatPrompt, SectionResult, example, generate_replies, reply_budget
from muse.llm import LLM
from muse.train.data import instructions
from muse.train.data.split import HELD_OUT

SORT_ITEMS = range(3, 9)
# Draws per wanted case before a cell is taken to be exhausted.
DRAWS_PER_CASE = 50


def held_out_sort_cases(rng: random.Random, items: int, num: int
                        ) -> list[instructions.InstructionCase]:
    """Up to `num` distinct held-out sorting cases of `items` items."""
    found: dict[str, instructions.InstructionCase] = {}
    for _ in range(num * DRAWS_PER_CASE):
        case = instructions.sort_case(rng, HELD_OUT, items)
        found.setdefault(case.key, case)
        if len(found) == num:
            break
    return list(found.values())


def evaluate_sorting(llm: LLM, num: int, seed: int, max_tokens: int,
                     progress: bool | None = None) -> SectionResult:
    rng = random.Random(f"eval-sorting/{seed}")
    cases, prompts = [], []
    for items in SORT_ITEMS:
        for case in held_out_sort_cases(rng, items, num):
            question, answer = instructions.exchange(case)
            cases.append((items, case))
            prompts.append(ChatPrompt([question],
                                      max_tokens=reply_budget(llm, answer, max_tokens)))
    replies = generate_replies(llm, prompts, "sorting", progress)
    metrics: dict = {}
    examples = []
    for (items, case), prompt, reply in zip(cases, prompts, replies):
        ok = reply.content == case.answer
        cell = metrics.setdefault(str(items), {"count": 0, "exact": 0})
        cell["count"] += 1
        cell["exact"] += ok
        if len(examples) < 2 and items == 6:
            examples.append(example(prompt, reply, case.answer, ok))
    total = sum(cell["count"] for cell in metrics.values())
    correct = sum(cell["exact"] for cell in metrics.values())
    for cell in metrics.values():
        cell["exact"] /= cell["count"]
    metrics["overall"] = {"count": total, "exact": correct / total if total else 0.0}
    return SectionResult(metrics, replies, examples)

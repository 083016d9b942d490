"""Held-out short instructions: exact-match accuracy per kind (sort, reverse, count, copy,
answer from a context)."""

from __future__ import annotations

import random

from muse.eval.generation import ChatPrompt, SectionResult, example, generate_replies, reply_budget
from muse.llm import LLM
from muse.train.data import instructions
from muse.train.data.split import HELD_OUT

DRAWS_PER_CASE = 50


def evaluate_instructions(llm: LLM, num: int, seed: int, max_tokens: int,
                          progress: bool | None = None) -> SectionResult:
    rng = random.Random(f"eval-instructions/{seed}")
    cases, prompts = [], []
    for kind in instructions.KINDS:
        found: dict[str, instructions.InstructionCase] = {}
        for _ in range(num * DRAWS_PER_CASE):
            case = instructions.sample_case(rng, HELD_OUT, kind)
            found.setdefault(case.key, case)
            if len(found) == num:
                break
        for case in found.values():
            question, answer = instructions.exchange(case)
            cases.append(case)
            prompts.append(ChatPrompt([question],
                                      max_tokens=reply_budget(llm, answer, max_tokens)))
    replies = generate_replies(llm, prompts, "instructions", progress)
    metrics: dict[str, dict[str, float]] = {}
    examples = []
    for case, prompt, reply in zip(cases, prompts, replies):
        ok = reply.content == case.answer
        cell = metrics.setdefault(case.kind, {"count": 0, "exact": 0})
        cell["count"] += 1
        cell["exact"] += ok
        if len(examples) < len(instructions.KINDS) and not any(
                e["kind"] == case.kind for e in examples):
            examples.append({"kind": case.kind, **example(prompt, reply, case.answer, ok)})
    for cell in metrics.values():
        cell["exact"] /= cell["count"]
    return SectionResult(metrics, replies, examples)

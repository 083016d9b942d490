"""Whole conversations in the Muse chat format, drawn from a weighted registry of tasks.

A conversation is an optional system prompt (carrying the tool list when tools are offered)
and one to three exchanges. Every assistant turn opens with a reasoning block. New kinds of
example (images, video, audio: their user turns are content-part lists, which the chat
template already renders as placeholders) join by adding a `Task` to `TASKS`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from muse.train.data import arithmetic, instructions, tools

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Muse, a small assistant. Be brief.",
                  "Answer the user's question.", "You are a careful assistant that shows its work."]
SYSTEM_PROMPT_SHARE = 0.4
# Share of conversations with a second exchange, and of those, with a third.
FOLLOW_UP_SHARE = 0.2


@dataclass
class Conversation:
    """Messages in the OpenAI chat shape plus the tools offered (None for no tools).

    `task` names the kind of the first exchange; training logs its loss under that name.
    """

    task: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Task:
    name: str
    weight: float
    make: Callable[[random.Random, str], Conversation]


def _system(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < SYSTEM_PROMPT_SHARE:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def _plain_exchange(rng: random.Random, split: str, allow_addition: bool = True
                    ) -> list[dict[str, Any]]:
    """An arithmetic or instruction exchange, for follow-ups and tool-free turns."""
    if rng.random() < 0.6:
        operations = arithmetic.OPERATIONS if allow_addition else ("sub", "mul")
        problem = arithmetic.sample_problem(rng, split, operation=rng.choice(operations))
        return arithmetic.exchange(problem, rng)
    return instructions.exchange(instructions.sample_case(rng, split))


def _follow_ups(rng: random.Random, split: str, allow_addition: bool = True
                ) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    while len(messages) < 4 and rng.random() < FOLLOW_UP_SHARE:
        messages += _plain_exchange(rng, split, allow_addition)
    return messages


def arithmetic_conversation(rng: random.Random, split: str) -> Conversation:
    problem = arithmetic.sample_problem(rng, split)
    messages = _system(rng) + arithmetic.exchange(problem, rng) + _follow_ups(rng, split)
    return Conversation("arithmetic", messages)


def instruction_conversation(rng: random.Random, split: str) -> Conversation:
    case = instructions.sample_case(rng, split)
    messages = _system(rng) + instructions.exchange(case) + _follow_ups(rng, split)
    return Conversation("instructions", messages)


def tool_conversation(rng: random.Random, split: str) -> Conversation:
    """Tools offered in the system turn; usually the request needs one of them, sometimes it
    needs none and the assistant answers directly (an offered calculator is always used for
    additions, so tool-free turns then avoid addition)."""
    if rng.random() < 0.85:
        case = tools.sample_case(rng, split)
        offered = tools.offered_tools(rng, case.name)
        first = tools.exchange(case)
    else:
        offered = tools.offered_tools(rng, None)
        first = []
    names = {schema["function"]["name"] for schema in offered}
    allow_addition = "add_numbers" not in names
    if not first:
        first = _plain_exchange(rng, split, allow_addition)
    messages = _system(rng) + first + _follow_ups(rng, split, allow_addition)
    return Conversation("tools", messages, offered)


TASKS: list[Task] = [
    Task("arithmetic", 0.5, arithmetic_conversation),
    Task("tools", 0.3, tool_conversation),
    Task("instructions", 0.2, instruction_conversation),
]


def sample_conversation(rng: random.Random, split: str) -> Conversation:
    task = rng.choices(TASKS, weights=[t.weight for t in TASKS])[0]
    return task.make(rng, split)

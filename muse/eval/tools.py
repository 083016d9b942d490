"""Held-out tool use: does the reply make one call that parses, names an offered tool and
fits its schema (valid), with the expected tool and argument values (correct); and, given
the tool's result, does the next reply repeat the value it was asked for (answer_uses_result).

The second turn is always prompted with the right call and result, so it measures using a
result independently of whether the first call was right.
"""

from __future__ import annotations

import json
import random
from typing import Any

from muse.eval.generation import (ChatPrompt, SectionResult, example, generate_replies,
                                  reply_budget, strict)
from muse.eval.replies import Reply
from muse.eval.schema import schema_errors
from muse.llm import LLM
from muse.train.data import tools
from muse.train.data.conversations import SYSTEM_PROMPT_SHARE, SYSTEM_PROMPTS
from muse.train.data.split import HELD_OUT

DRAWS_PER_CASE = 50


def single_call(reply: Reply) -> dict[str, Any] | None:
    """The reply's one tool call as a JSON object; None unless it makes exactly one call
    and that call parses to an object."""
    calls = reply.parsed_tool_calls()
    return calls[0] if len(calls) == 1 and isinstance(calls[0], dict) else None


def call_is_valid(call: dict[str, Any] | None, offered: list[dict[str, Any]]) -> bool:
    """Whether `call` has exactly the keys name and arguments, names an offered tool and
    its arguments satisfy that tool's parameter schema."""
    if call is None:
        return False
    schemas = {schema["function"]["name"]: schema["function"] for schema in offered}
    name, arguments = call.get("name"), call.get("arguments")
    return (set(call) == {"name", "arguments"} and isinstance(name, str) and name in schemas
            and isinstance(arguments, dict)
            and not schema_errors(arguments, schemas[name]["parameters"]))


def check_call(reply: Reply, offered: list[dict[str, Any]], case: tools.ToolCase
               ) -> tuple[bool, bool]:
    """(valid, correct) of the reply's tool call."""
    call = single_call(reply)
    valid = call_is_valid(call, offered)
    return valid, (valid and call is not None and call["name"] == case.name
                   and call["arguments"] == case.arguments)


def held_out_cases(rng: random.Random, num: int) -> list[tools.ToolCase]:
    """`num` distinct held-out requests, spread evenly over the tools (fewer if a tool's
    held-out requests run out)."""
    names = sorted(tools.MAKERS)
    found: dict[str, tools.ToolCase] = {}
    for draw in range(num * DRAWS_PER_CASE):
        case = tools.sample_case(rng, HELD_OUT, names[draw % len(names)])
        found.setdefault(case.key, case)
        if len(found) == num:
            break
    return list(found.values())


def evaluate_tools(llm: LLM, num: int, seed: int, max_tokens: int,
                   progress: bool | None = None, strict_tools: bool = False) -> SectionResult:
    rng = random.Random(f"eval-tools/{seed}")
    cases = held_out_cases(rng, num)
    calls, answers, offered_lists = [], [], []
    for case in cases:
        offered = tools.offered_tools(rng, case.name)
        system = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] \
            if rng.random() < SYSTEM_PROMPT_SHARE else []
        user, call, result, answer = tools.exchange(case, offered)
        request = system + [user]
        sent = strict(offered, strict_tools)
        calls.append(ChatPrompt(request, sent, reply_budget(llm, call, max_tokens)))
        answers.append(ChatPrompt(request + [call, result], sent,
                                  reply_budget(llm, answer, max_tokens)))
        offered_lists.append(offered)
    call_replies = generate_replies(llm, calls, "tool calls", progress)
    answer_replies = generate_replies(llm, answers, "tool answers", progress)
    by_tool: dict[str, dict[str, float]] = {}
    examples = []
    valid_count = correct_count = used_count = 0
    for case, offered, prompt, call_reply, answer_reply in zip(
            cases, offered_lists, calls, call_replies, answer_replies):
        valid, correct = check_call(call_reply, offered, case)
        used = case.answer_value in answer_reply.content
        valid_count += valid
        correct_count += correct
        used_count += used
        cell = by_tool.setdefault(case.name, {"count": 0, "valid": 0, "correct": 0})
        cell["count"] += 1
        cell["valid"] += valid
        cell["correct"] += correct
        if len(examples) < 4:
            expected = json.dumps({"name": case.name, "arguments": case.arguments})
            examples.append(example(prompt, call_reply, expected, correct))
    for cell in by_tool.values():
        cell["valid"] /= cell["count"]
        cell["correct"] /= cell["count"]
    count = len(cases)
    metrics = {"count": count,
               "valid": valid_count / count if count else 0.0,
               "correct": correct_count / count if count else 0.0,
               "answer_uses_result": used_count / count if count else 0.0,
               "by_tool": by_tool}
    return SectionResult(metrics, call_replies + answer_replies, examples)

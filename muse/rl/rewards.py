"""Rewards: a completion's text and its task in, a float out.

A reward sees the reply text as decoded with special tokens kept (`<think>`, `<tool_call>`
are single special tokens; decode with skip_special_tokens=False), so it reads the reply
the way the model wrote it.
"""

from __future__ import annotations

import importlib
import json
import re
from decimal import Decimal
from typing import Any, Protocol

from muse.chat_format import END_OF_TURN_TOKEN, THINK_END_TOKEN, THINK_START_TOKEN
from muse.rl.tool_env import ToolEnvironment, reply_tool_calls
from muse.rl.unseen_tool_tasks import unseen_tool_reward

# An optionally negative number, thousands separated by commas or not, maybe with decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class Reward(Protocol):
    def __call__(self, completion: str, task: dict[str, Any]) -> float:
        """The reward of `completion` (one sampled reply, or a rollout's replies joined) for
        `task` (a dict from `muse.rl.tasks`)."""
        ...


def answer_text(completion: str) -> str:
    """The part of a reply that answers: the text after the last `</think>`. A reply that
    opens a reasoning block and never closes it (out of tokens) has no answer."""
    if THINK_END_TOKEN in completion:
        return completion.rpartition(THINK_END_TOKEN)[2]
    if completion.lstrip().startswith(THINK_START_TOKEN):
        return ""
    return completion


def final_number(text: str) -> Decimal | None:
    """The last number written in `text` ("1,234" reads 1234), or None without one."""
    numbers = _NUMBER.findall(text)
    return Decimal(numbers[-1].replace(",", "")) if numbers else None


def arithmetic_reward(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the last number of the answer equals int(task["answer"]), else 0.0.

    Only the answer counts: the worked reasoning ends with "So 579." as well, and a reply cut
    off inside its reasoning must not be paid for it. "579.0" counts as 579; "579.5" does not.
    """
    number = final_number(answer_text(completion))
    return float(number is not None and number == int(task["answer"]))


def _answer_of_turn(completion: str) -> str:
    """The answer up to the end of the turn, without surrounding whitespace."""
    return answer_text(completion).partition(END_OF_TURN_TOKEN)[0].strip()


def exact_answer_reward(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the answer, up to the end of the turn and without surrounding whitespace, is
    str(task["answer"]) exactly (as the instructions and sorting eval sections score it)."""
    return float(_answer_of_turn(completion) == str(task["answer"]))


def list_positions_reward(completion: str, task: dict[str, Any]) -> float:
    """The share of the positions of the comma-separated list str(task["answer"]) that the
    answer fills with the right item, over the longer of the two lists: 1.0 exactly when
    `exact_answer_reward` is 1.0, partial credit for a list with a swap, a duplicate or a
    missing item (a dense reward for sorting-like tasks; the eval stays exact match)."""
    answer = _answer_of_turn(completion)
    written = [item.strip() for item in answer.split(",")] if answer else []
    expected = [item.strip() for item in str(task["answer"]).split(",")]
    right = sum(a == b for a, b in zip(written, expected))
    return right / max(len(written), len(expected))


def _same_number(value: Any, expected: Any) -> bool:
    """A JSON number (not a bool) equal to `expected` (12 and 12.0 are the same)."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and value == expected)


def tool_call_reward(completion: str, task: dict[str, Any]) -> float:
    """1.0 when the reply's tool calls, executed in order against a fresh
    `ToolEnvironment(task["facts"])`, all succeed and the last one names
    task["expected_call"]["name"] and returns task["answer"]; else 0.0.

    `completion` is every assistant turn of the rollout joined in order (or just the last
    turn that makes a call: the tools are deterministic, so re-running the last call gives
    the result the rollout saw). Calls are read with muse's server parser after removing
    reasoning blocks; a malformed `<tool_call>` block, a call to a tool not in task["tools"],
    a failed call or no call at all gives 0.0. Only the final call's name and returned value
    are compared, not its arguments: any correct route to the answer counts. The prose of
    the final answer is not scored.
    """
    calls = reply_tool_calls(completion, task.get("tools"))
    if not calls:
        return 0.0
    environment = ToolEnvironment(task.get("facts", {}))
    for call in calls:
        environment.execute(call.name, json.loads(call.arguments))
    if environment.failed:
        return 0.0
    last = environment.history[-1]
    return float(last.name == task["expected_call"]["name"]
                 and _same_number(last.result, task["answer"]))


BUILTIN_REWARDS: dict[str, Reward] = {"arithmetic": arithmetic_reward,
                                      "exact_answer": exact_answer_reward,
                                      "list_positions": list_positions_reward,
                                      "tool_call": tool_call_reward,
                                      "unseen_tool_call": unseen_tool_reward}


def load_reward(spec: str) -> Reward:
    """A built-in reward by name (one of BUILTIN_REWARDS) or a callable given as
    "package.module:function", imported."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"reward {spec!r} is neither a built-in reward "
                         f"({', '.join(sorted(BUILTIN_REWARDS))}) nor 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({error})") \
            from error
    reward = getattr(module, attribute, None)
    if not callable(reward):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no callable "
                         f"{attribute!r}")
    return reward

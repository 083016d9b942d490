"""A small deterministic tool environment for multi-turn RL rollouts and tool-call rewards.

Tools are OpenAI function schemas plus Python implementations: arithmetic (add, subtract,
multiply), `lookup_fact` over a table of facts the task supplies, and exact unit conversion.
Facts come from the task rather than from the environment so a model cannot learn them by
heart: the only way to the answer is to call the tool.

A rollout turns each tool call of a reply into a `tool` message whose content is
`execute`'s JSON text; the chat template renders it as `<|tool|>{content}<|end|>\\n`, and only
that newly appended text is tokenized (the reply's own token ids are kept as sampled).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from muse.chat_format import THINK_END_TOKEN, THINK_START_TOKEN, TOOL_CALL_START_TOKEN
from muse.eval.schema import schema_errors
from muse.server.parsers.tool_calls import MuseToolCallParser, ParsedToolCall
from muse.train.data.tools import TOOL_SCHEMAS, function_schema

# Units of one dimension convert into each other, exactly (factors to the dimension's base).
UNIT_FACTORS: dict[str, tuple[str, Fraction]] = {
    "mm": ("length", Fraction(1, 1000)), "cm": ("length", Fraction(1, 100)),
    "m": ("length", Fraction(1)), "km": ("length", Fraction(1000)),
    "g": ("mass", Fraction(1)), "kg": ("mass", Fraction(1000)),
    "seconds": ("time", Fraction(1)), "minutes": ("time", Fraction(60)),
    "hours": ("time", Fraction(3600)),
}
UNITS = list(UNIT_FACTORS)

_NUMBERS = {"a": {"type": "number"}, "b": {"type": "number"}}
# add_numbers keeps the schema the shipped model was trained on.
ARITHMETIC_SCHEMAS = {
    "add_numbers": TOOL_SCHEMAS["add_numbers"],
    "subtract_numbers": function_schema("subtract_numbers", "Subtract b from a.", _NUMBERS,
                                        ["a", "b"]),
    "multiply_numbers": function_schema("multiply_numbers", "Multiply two numbers.", _NUMBERS,
                                        ["a", "b"]),
}
LOOKUP_SCHEMA = function_schema("lookup_fact", "Look up a stored fact by its exact key.",
                                {"key": {"type": "string"}}, ["key"])
CONVERT_SCHEMA = function_schema(
    "convert_units", "Convert a value between units of the same kind.",
    {"value": {"type": "number"}, "from_unit": {"type": "string", "enum": UNITS},
     "to_unit": {"type": "string", "enum": UNITS}},
    ["value", "from_unit", "to_unit"])

_THINK_BLOCK = re.compile(re.escape(THINK_START_TOKEN) + r".*?(?:" + re.escape(THINK_END_TOKEN)
                          + r"|\Z)", re.DOTALL)


class ToolError(Exception):
    """A call the tool cannot carry out (unknown key, incompatible units): the model's error."""


def _plain_number(value: Fraction | int | float) -> int | float:
    """An int when the value is whole (so 330 * 1000 reads 330000, not 330000.0)."""
    if isinstance(value, Fraction):
        return int(value) if value.denominator == 1 else float(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def convert_units(value: int | float, from_unit: str, to_unit: str) -> int | float:
    """`value` in `from_unit` expressed in `to_unit`, exactly (both units of UNIT_FACTORS)."""
    (from_kind, from_factor), (to_kind, to_factor) = UNIT_FACTORS[from_unit], UNIT_FACTORS[to_unit]
    if from_kind != to_kind:
        raise ToolError(f"cannot convert {from_unit} ({from_kind}) to {to_unit} ({to_kind})")
    return _plain_number(Fraction(value) * from_factor / to_factor)


@dataclass(frozen=True)
class Tool:
    """An OpenAI function schema and the function that runs a call with its arguments."""

    schema: dict[str, Any]
    run: Callable[..., Any]

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


@dataclass(frozen=True)
class ToolCallRecord:
    """One executed call: `result` is the tool's value, or None when `error` says why not."""

    name: str
    arguments: Any
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def builtin_tools(facts: Mapping[str, Any]) -> list[Tool]:
    """The arithmetic, lookup and unit tools, `lookup_fact` reading `facts`."""

    def lookup_fact(key: str) -> Any:
        if key not in facts:
            raise ToolError(f"no fact with key {key!r}; known keys: {sorted(facts)}")
        return facts[key]

    return [
        Tool(ARITHMETIC_SCHEMAS["add_numbers"], lambda a, b: _plain_number(a + b)),
        Tool(ARITHMETIC_SCHEMAS["subtract_numbers"], lambda a, b: _plain_number(a - b)),
        Tool(ARITHMETIC_SCHEMAS["multiply_numbers"], lambda a, b: _plain_number(a * b)),
        Tool(LOOKUP_SCHEMA, lookup_fact),
        Tool(CONVERT_SCHEMA, convert_units),
    ]


class ToolEnvironment:
    """Runs tool calls and records them; `history` is what a reward inspects afterwards.

    Built from `facts` (the task's lookup table) with the built-in tools, or from any
    `tools`. Calls never raise: a failure is the model's mistake and becomes an error text
    the model reads in its next turn, never a crashed rollout.
    """

    def __init__(self, facts: Mapping[str, Any] | None = None,
                 tools: Sequence[Tool] | None = None) -> None:
        if facts is not None and tools is not None:
            raise ValueError("give facts (for the built-in tools) or tools, not both")
        chosen = tools if tools is not None else builtin_tools(facts or {})
        self._tools = {tool.name: tool for tool in chosen}
        self.history: list[ToolCallRecord] = []

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI tool schemas to offer (pass as the chat template's `tools`)."""
        return [tool.schema for tool in self._tools.values()]

    @property
    def failed(self) -> bool:
        """Whether any call so far failed."""
        return any(not record.ok for record in self.history)

    def execute(self, name: str, arguments: Any) -> str:
        """JSON text `{"result": value}`, or `{"error": why}` for an unknown tool, arguments
        that do not fit the schema or a call the tool cannot carry out (recorded as failed)."""
        record = self._run(name, arguments)
        self.history.append(record)
        if record.ok:
            return json.dumps({"result": record.result})
        return json.dumps({"error": record.error})

    def _run(self, name: str, arguments: Any) -> ToolCallRecord:
        tool = self._tools.get(name)
        if tool is None:
            return ToolCallRecord(name, arguments,
                                  error=f"unknown tool {name!r}; available: {sorted(self._tools)}")
        parameters = tool.schema["function"]["parameters"]
        errors = schema_errors(arguments, parameters)
        if not errors:
            errors = [f"arguments has unknown property `{key}`" for key in arguments
                      if key not in parameters.get("properties", {})]
        if errors:
            return ToolCallRecord(name, arguments, error="; ".join(errors))
        try:
            result = tool.run(**arguments)
            json.dumps(result, allow_nan=False)  # NaN / inf are not JSON a model can read
        except Exception as error:  # any failure is the call's, never the rollout's
            return ToolCallRecord(name, arguments, error=f"{type(error).__name__}: {error}")
        return ToolCallRecord(name, arguments, result=result)

    def respond(self, reply: str, offered: list[dict[str, Any]] | None = None
                ) -> list[dict[str, Any]]:
        """The `tool` messages answering a reply's calls, in order (empty without calls).

        A malformed `<tool_call>` block gets an error message too, so the model learns from
        its next turn that the call did not happen.
        """
        calls = reply_tool_calls(reply, offered)
        if calls is None:
            self.history.append(ToolCallRecord("", None, error="malformed tool call"))
            return [{"role": "tool", "content": json.dumps(
                {"error": "a <tool_call> block is not valid JSON with a string name and an "
                          "object arguments, or names a tool that was not offered"})}]
        return [{"role": "tool", "content": self.execute(call.name, json.loads(call.arguments))}
                for call in calls]


def without_reasoning(text: str) -> str:
    """`text` without its `<think>...</think>` blocks; an unclosed block runs to the end
    (the model ran out of tokens while reasoning)."""
    return _THINK_BLOCK.sub("", text)


def reply_tool_calls(reply: str, offered: list[dict[str, Any]] | None = None
                     ) -> list[ParsedToolCall] | None:
    """The reply's tool calls in order, parsed by muse's own server parser; None when any
    `<tool_call>` block is malformed (or, given `offered`, names a tool not offered).

    Reasoning is removed first: a call the model only thinks about is not made. The reply
    must keep its special tokens as text (decode with skip_special_tokens=False).
    """
    content, calls = MuseToolCallParser(offered).parse(without_reasoning(reply))
    if content is not None and TOOL_CALL_START_TOKEN in content:
        return None
    return calls

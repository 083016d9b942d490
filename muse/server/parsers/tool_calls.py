"""Extracts `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks from content.

A block only becomes a tool call when its JSON parses into a string `name` and an object
`arguments` (and, when tools were offered, names one of them). Anything else stays in the
content as the raw text the model wrote, so a client never receives a broken call.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Union

from muse.chat_format import TOOL_CALL_END_TOKEN, TOOL_CALL_START_TOKEN
from muse.server.parsers.reasoning import partial_tag_length


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # the arguments object as compact JSON text
    id: str = field(default_factory=new_tool_call_id)


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgumentsDelta:
    index: int
    text: str


ToolCallEvent = Union[ContentDelta, ToolCallStart, ToolCallArgumentsDelta]


def offered_tool_names(tools: list[dict[str, Any]]) -> set[str]:
    """Names of OpenAI tool dicts, accepting the `{"type": "function", "function": {...}}`
    shape and the bare function shape, as the chat template does."""
    return {tool.get("function", tool)["name"] for tool in tools}


def _reject_constant(constant: str) -> None:
    # Python's json accepts NaN and Infinity, which are not JSON and would reach clients as such.
    raise ValueError(f"{constant} is not valid JSON")


def parse_tool_call(body: str, allowed_names: set[str] | None) -> ParsedToolCall | None:
    """The call in the text between the tags, or None when it is not a valid call."""
    try:
        call = json.loads(body, parse_constant=_reject_constant)
        if not isinstance(call, dict):
            return None
        name, arguments = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return None
        if allowed_names is not None and name not in allowed_names:
            return None
        return ParsedToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
    except (ValueError, RecursionError):
        # Nesting deeper than Python's JSON can read (or write back) is not a call we can
        # pass on; the text stays content.
        return None


class MuseToolCallParser:
    """`parse` for whole replies; `feed` / `finish` for one streamed reply per instance.

    `tools` are the OpenAI tool dicts offered in the request; when given, calls to other
    names stay in the content. None accepts any name.
    """

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._allowed_names = None if tools is None else offered_tool_names(tools)
        self._inside_call = False
        self._held = ""  # a possible partial start tag, or the open block's text
        self._num_calls = 0

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content without the tool-call blocks or None if empty, tool calls in order)."""
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        position = 0
        while (start := text.find(TOOL_CALL_START_TOKEN, position)) >= 0:
            content.append(text[position:start])
            body_start = start + len(TOOL_CALL_START_TOKEN)
            end = text.find(TOOL_CALL_END_TOKEN, body_start)
            # An unclosed block runs to the end of the reply (the model ran out of tokens).
            body_end = len(text) if end < 0 else end
            block_end = len(text) if end < 0 else end + len(TOOL_CALL_END_TOKEN)
            call = parse_tool_call(text[body_start:body_end], self._allowed_names)
            if call is None:
                content.append(text[start:block_end])
            else:
                calls.append(call)
            position = block_end
        content.append(text[position:])
        return "".join(content) or None, calls

    def feed(self, delta: str) -> list[ToolCallEvent]:
        """Events settled after `delta`. A tool-call block is held until it closes, so its
        arguments are only sent once they are known to be valid."""
        self._held += delta
        events: list[ToolCallEvent] = []
        while True:
            if self._inside_call:
                body, closed, rest = self._held.partition(TOOL_CALL_END_TOKEN)
                if not closed:
                    return events
                events += self._close_block(body, closed)
                self._inside_call, self._held = False, rest
                continue
            text, opened, rest = self._held.partition(TOOL_CALL_START_TOKEN)
            if not opened:
                settled = len(text) - partial_tag_length(text, TOOL_CALL_START_TOKEN)
                if settled:
                    events.append(ContentDelta(text[:settled]))
                self._held = text[settled:]
                return events
            if text:
                events.append(ContentDelta(text))
            self._inside_call, self._held = True, rest

    def finish(self) -> list[ToolCallEvent]:
        """Releases held text at the end of generation; an unclosed block that still holds
        a complete call is that call."""
        held, self._held = self._held, ""
        if self._inside_call:
            self._inside_call = False
            return self._close_block(held, "")
        return [ContentDelta(held)] if held else []

    def _close_block(self, body: str, end_tag: str) -> list[ToolCallEvent]:
        call = parse_tool_call(body, self._allowed_names)
        if call is None:
            return [ContentDelta(TOOL_CALL_START_TOKEN + body + end_tag)]
        index, self._num_calls = self._num_calls, self._num_calls + 1
        return [ToolCallStart(index, call.id, call.name), ToolCallArgumentsDelta(index, call.arguments)]

"""Turns the assistant's generated text into OpenAI message fields, whole or streamed.

Reasoning is split off first and tool calls are looked for in the content only, so a
tool call the model merely thought about is never executed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muse.server.parsers.reasoning import Channel, MuseReasoningParser
from muse.server.parsers.tool_calls import (
    ContentDelta,
    MuseToolCallParser,
    ParsedToolCall,
    ToolCallArgumentsDelta,
    ToolCallEvent,
    ToolCallStart,
)


@dataclass
class ToolCallDelta:
    """One entry of an OpenAI streaming `delta.tool_calls`: `id` and `name` come once, in
    the call's first delta; `arguments` is the next piece of the arguments JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class DeltaMessage:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return self.reasoning_content is None and self.content is None and not self.tool_calls


@dataclass
class ParsedMessage:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ParsedToolCall]


class ChatOutputParser:
    """Parses one reply: `parse` for a whole reply, or `feed` each new piece of text and
    `finish` at the end of generation.

    reasoning: split off a leading `<think>` block (else think tags are plain content).
    tools: extract tool-call blocks (else they are plain content).
    offered_tools: the request's OpenAI tool dicts; calls to other names stay content.
    thinking: False when the prompt already closed the reasoning block (see
    MuseReasoningParser).
    """

    def __init__(
        self, reasoning: bool, tools: bool, offered_tools: list[dict[str, Any]] | None = None,
        thinking: bool = True,
    ) -> None:
        self._reasoning_parser = MuseReasoningParser(thinking) if reasoning else None
        self._tool_parser = MuseToolCallParser(offered_tools) if tools else None

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self._reasoning_parser is not None:
            reasoning, content = self._reasoning_parser.parse(text)
        if self._tool_parser is None:
            return ParsedMessage(reasoning, content or None, [])
        content_without_calls, calls = self._tool_parser.parse(content)
        return ParsedMessage(reasoning, content_without_calls, calls)

    def feed(self, delta_text: str) -> DeltaMessage:
        if self._reasoning_parser is None:
            return self._route([("content", delta_text)], final=False)
        return self._route(self._reasoning_parser.feed(delta_text), final=False)

    def finish(self) -> DeltaMessage:
        pieces = self._reasoning_parser.finish() if self._reasoning_parser is not None else []
        return self._route(pieces, final=True)

    def _route(self, pieces: list[tuple[Channel, str]], final: bool) -> DeltaMessage:
        message = DeltaMessage()
        for channel, text in pieces:
            if channel == "reasoning":
                message.reasoning_content = (message.reasoning_content or "") + text
            elif self._tool_parser is None:
                _add_content(message, text)
            else:
                _add_events(message, self._tool_parser.feed(text))
        if final and self._tool_parser is not None:
            _add_events(message, self._tool_parser.finish())
        return message


def _add_content(message: DeltaMessage, text: str) -> None:
    if text:
        message.content = (message.content or "") + text


def _add_events(message: DeltaMessage, events: list[ToolCallEvent]) -> None:
    for event in events:
        if isinstance(event, ContentDelta):
            _add_content(message, event.text)
        elif isinstance(event, ToolCallStart):
            message.tool_calls.append(ToolCallDelta(event.index, event.id, event.name))
        elif isinstance(event, ToolCallArgumentsDelta):
            last = message.tool_calls[-1] if message.tool_calls else None
            if last is not None and last.index == event.index:
                last.arguments += event.text
            else:
                message.tool_calls.append(ToolCallDelta(event.index, arguments=event.text))

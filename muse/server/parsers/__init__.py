"""Parsers for the assistant's output: reasoning, tool calls, and both combined."""

from muse.server.parsers.chat_output import ChatOutputParser, DeltaMessage, ParsedMessage, ToolCallDelta
from muse.server.parsers.reasoning import MuseReasoningParser
from muse.server.parsers.tool_calls import (
    ContentDelta,
    MuseToolCallParser,
    ParsedToolCall,
    ToolCallArgumentsDelta,
    ToolCallEvent,
    ToolCallStart,
)

__all__ = [
    "ChatOutputParser",
    "ContentDelta",
    "DeltaMessage",
    "MuseReasoningParser",
    "MuseToolCallParser",
    "ParsedMessage",
    "ParsedToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallDelta",
    "ToolCallEvent",
    "ToolCallStart",
]

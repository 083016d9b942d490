"""Reading one generated assistant reply: its reasoning block, content, tool calls and ending.

The reply is read from token ids, not text, because the markers (`<think>`, `<tool_call>`,
`<|end|>`) are single special tokens: a reply that spells them out in ordinary characters
has not produced them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from muse.chat_format import (
    END_OF_TURN_ID,
    THINK_END_ID,
    THINK_START_ID,
    TOOL_CALL_END_ID,
    TOOL_CALL_START_ID,
)
from muse.outputs import CompletionOutput
from muse.tokenizer import MuseTokenizer


@dataclass
class Reply:
    """What a completion says, and whether it has the shape the chat format requires."""

    text: str  # the whole reply with its special tokens, for reports
    reasoning: str | None  # inside the one well-formed <think> block; None without one
    content: str  # after the reasoning block, tool calls removed, stripped
    tool_calls: list[str] = field(default_factory=list)  # raw text inside each <tool_call>
    ends_with_end_of_turn: bool = False
    think_well_formed: bool = False

    def parsed_tool_calls(self) -> list[Any]:
        """Each call's JSON value, or None where it does not parse."""
        calls = []
        for raw in self.tool_calls:
            try:
                calls.append(json.loads(raw))
            except json.JSONDecodeError:
                calls.append(None)
        return calls


def read_reply(output: CompletionOutput, tokenizer: MuseTokenizer) -> Reply:
    ids = list(output.token_ids)
    ends = output.finish_reason == "stop" and bool(ids) and ids[-1] == END_OF_TURN_ID
    body = ids[:-1] if ends else ids
    # Exactly one reasoning block, and it opens the reply.
    think_ok = (body[:1] == [THINK_START_ID] and body.count(THINK_START_ID) == 1
                and body.count(THINK_END_ID) == 1)
    reasoning = None
    if think_ok:
        close = body.index(THINK_END_ID)
        reasoning = tokenizer.decode(body[1:close])
        body = body[close + 1:]
    content_ids: list[int] = []
    tool_calls: list[str] = []
    position = 0
    while position < len(body):
        token = body[position]
        if token == TOOL_CALL_START_ID and TOOL_CALL_END_ID in body[position:]:
            close = body.index(TOOL_CALL_END_ID, position)
            tool_calls.append(tokenizer.decode(body[position + 1:close]))
            position = close + 1
            continue
        content_ids.append(token)
        position += 1
    return Reply(text=tokenizer.decode(ids), reasoning=reasoning,
                 content=tokenizer.decode(content_ids).strip(), tool_calls=tool_calls,
                 ends_with_end_of_turn=ends, think_well_formed=think_ok)

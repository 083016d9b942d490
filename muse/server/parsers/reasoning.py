"""Splits an assistant reply into reasoning (`<think>...</think>`) and content.

Reasoning is only recognised when the reply starts with `<think>` (after optional
whitespace): a think tag later in the reply is ordinary text. A think block that never
closes (the model ran out of tokens) is all reasoning.
"""

from __future__ import annotations

from typing import Literal

from muse.chat_format import THINK_END_TOKEN, THINK_START_TOKEN

Channel = Literal["reasoning", "content"]


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`.

    Streaming parsers hold back exactly this many characters: they may be a tag split
    across chunks, and everything before them can no longer be.
    """
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


class MuseReasoningParser:
    """`parse` for whole replies; `feed` / `finish` for one streamed reply per instance."""

    def __init__(self) -> None:
        # "start": not yet known whether the reply opens with <think>.
        self._state: Literal["start", "reasoning", "content"] = "start"
        self._held = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content); reasoning is None when the reply has no think block."""
        stripped = text.lstrip()
        if not stripped.startswith(THINK_START_TOKEN):
            return None, text
        reasoning, _, content = stripped[len(THINK_START_TOKEN) :].partition(THINK_END_TOKEN)
        return reasoning, content

    def feed(self, delta: str) -> list[tuple[Channel, str]]:
        """Pieces of the reply that are settled after `delta`, in order."""
        self._held += delta
        pieces: list[tuple[Channel, str]] = []
        if self._state == "start":
            stripped = self._held.lstrip()
            if stripped.startswith(THINK_START_TOKEN):
                self._state = "reasoning"
                self._held = stripped[len(THINK_START_TOKEN) :]
            elif THINK_START_TOKEN.startswith(stripped):
                return pieces  # only whitespace or part of <think> so far
            else:
                self._state = "content"
        if self._state == "reasoning":
            reasoning, closed, rest = self._held.partition(THINK_END_TOKEN)
            if closed:
                self._state = "content"
                self._held = rest
            else:
                settled = len(reasoning) - partial_tag_length(reasoning, THINK_END_TOKEN)
                reasoning, self._held = reasoning[:settled], reasoning[settled:]
            if reasoning:
                pieces.append(("reasoning", reasoning))
        if self._state == "content" and self._held:
            pieces.append(("content", self._held))
            self._held = ""
        return pieces

    def finish(self) -> list[tuple[Channel, str]]:
        """Releases held text at the end of generation: an open think block is reasoning."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [("reasoning" if self._state == "reasoning" else "content", held)]

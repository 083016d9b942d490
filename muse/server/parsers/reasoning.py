"""Splits an assistant reply into reasoning (`<think>...</think>`) and content.

Reasoning is only recognised when the reply starts with `<think>` (after optional
whitespace): a think tag later in the reply is ordinary text. A think block that never
closes (the model ran out of tokens) is all reasoning.
"""

from __future__ import annotations

from typing import Literal

from muse.chat_format import THINK_END_TOKEN, THINK_START_TOKEN
from muse.reasoning import split_reasoning

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
    """`parse` for whole replies; `feed` / `finish` for one streamed reply per instance.

    thinking=False: the prompt closed the reasoning block (thinking disabled). A model that
    reasons anyway and closes the block itself has the text before its `</think>` read as
    reasoning (see `split_reasoning`). Since that is only known once the tag comes, a stream
    holds the reply back until then (or until the end, when it is all content), so streamed
    and whole replies always agree and no tag reaches the content.
    """

    def __init__(self, thinking: bool = True) -> None:
        # "start": not yet known whether the reply opens with <think>; "undecided": thinking
        # disabled, no </think> yet.
        self._state: Literal["start", "undecided", "reasoning", "content"] = \
            "start" if thinking else "undecided"
        self._thinking = thinking
        self._held = ""

    def parse(self, text: str) -> tuple[str | None, str]:
        """(reasoning_content, content); reasoning is None when the reply has no think block."""
        return split_reasoning(text, self._thinking)

    def feed(self, delta: str) -> list[tuple[Channel, str]]:
        """Pieces of the reply that are settled after `delta`, in order."""
        if self._state == "undecided" or not self._thinking and self._state == "content":
            return self._feed_without_thinking(delta)
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

    def _feed_without_thinking(self, delta: str) -> list[tuple[Channel, str]]:
        if self._state == "content":
            text = delta.replace(THINK_START_TOKEN, "").replace(THINK_END_TOKEN, "")
            return [("content", text)] if text else []
        self._held += delta
        if THINK_END_TOKEN not in self._held:
            return []
        held, self._held, self._state = self._held, "", "content"
        return _pieces(*split_reasoning(held, thinking=False))

    def finish(self) -> list[tuple[Channel, str]]:
        """Releases held text at the end of generation: an open think block is reasoning."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self._state == "undecided":
            return _pieces(*split_reasoning(held, thinking=False))
        return [("reasoning" if self._state == "reasoning" else "content", held)]


def _pieces(reasoning: str | None, content: str) -> list[tuple[Channel, str]]:
    return [(channel, text) for channel, text in (("reasoning", reasoning), ("content", content))
            if text]

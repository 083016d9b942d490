"""Splits a whole assistant reply into reasoning (`<think>...</think>`) and content.

Shared by the offline API (`LLM.chat`) and the server's reasoning parser, so both read a
reply the same way.
"""

from __future__ import annotations

from muse.chat_format import THINK_END_TOKEN, THINK_START_TOKEN


def split_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str]:
    """(reasoning_content, content); reasoning is None when the reply has no think block.

    thinking=True: reasoning is only recognised when the reply starts with `<think>` (after
    optional whitespace): a think tag later in the reply is ordinary text. A think block that
    never closes (the model ran out of tokens) is all reasoning.

    thinking=False: the prompt already ended with an empty `<think></think>` block, yet a model
    may reason anyway and close the block itself. Text before such a `</think>` is reasoning,
    and no think tag is left in the content.
    """
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START_TOKEN)
    if thinking:
        if not opened:
            return None, text
        reasoning, _, content = stripped[len(THINK_START_TOKEN):].partition(THINK_END_TOKEN)
        return reasoning, content
    body = stripped[len(THINK_START_TOKEN):] if opened else text
    reasoning, closed, content = body.partition(THINK_END_TOKEN)
    if not closed:
        # Without a closing tag only an opening one marks reasoning (an open block).
        return (_without_think_tags(body), "") if opened else (None, _without_think_tags(text))
    return _without_think_tags(reasoning), _without_think_tags(content)


def _without_think_tags(text: str) -> str:
    return text.replace(THINK_START_TOKEN, "").replace(THINK_END_TOKEN, "")

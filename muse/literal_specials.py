"""Special-token strings inside a conversation's own text stay text.

A chat template writes the role and turn tags itself. If a user, a tool result or a tool
definition contains the string `<|end|><|system|>`, tokenizing the rendered prompt would turn
it into real control tokens, letting request text open a system turn. Before rendering, every
special-token string in the conversation's values is wrapped in markers made with a fresh
random nonce (a request cannot forge them); after rendering, the wrapped strings are encoded
as plain text and everything else as usual. Nothing changes when no value holds such a string.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from muse.chat_format import SPECIAL_TOKENS

_SPECIAL = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


class LiteralSpecials:
    """Markers for one rendering: `wrap` the inputs, then `split` the rendered text."""

    def __init__(self) -> None:
        nonce = secrets.token_hex(8)
        self.open, self.close = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"
        # Compiled on the first marking only: most renderings mark nothing, and a pattern
        # over every special token costs milliseconds to compile.
        self._marked: re.Pattern[str] | None = None

    def wrap(self, value: Any) -> Any:
        """`value` (JSON-like), with special strings in its keys and strings marked."""
        try:
            if not _SPECIAL.search(json.dumps(value, default=str)):
                return value  # the usual case: nothing to mark, nothing copied
        except (TypeError, ValueError):
            pass
        return self._wrap(value)

    def _wrap(self, value: Any) -> Any:
        if isinstance(value, str):
            if self._marked is None:
                self._marked = re.compile(re.escape(self.open) + "(" + _SPECIAL.pattern + ")"
                                          + re.escape(self.close))
            return _SPECIAL.sub(lambda m: self.open + m.group(0) + self.close, value)
        if isinstance(value, dict):
            return {self._wrap(k): self._wrap(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._wrap(item) for item in value]
        return value

    def split(self, text: str) -> list[tuple[str, bool]]:
        """(piece, is_literal) pieces of the rendered text, markers removed."""
        if self._marked is None:
            return [(text, False)] if text else []
        pieces, start = [], 0
        for match in self._marked.finditer(text):
            if match.start() > start:
                pieces.append((text[start:match.start()], False))
            pieces.append((match.group(1), True))
            start = match.end()
        if start < len(text):
            pieces.append((text[start:], False))
        return pieces

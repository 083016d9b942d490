"""One sample's grammar state: an xgrammar matcher, held back while the model reasons.

As in vLLM, a reply that opens with a reasoning block is free until the block's end token is
sampled; the grammar constrains every token after it. Whether the reply opens one is decided
by its first token, as the reasoning parser decides it: that token may be the grammar's or
the block's start token. Before the block ends the matcher sees nothing, so the JSON (or tool
call) it enforces starts right after the end token.
"""

from __future__ import annotations

from typing import Any, Literal

State = Literal["opening", "reasoning", "constrained"]


class RequestGrammar:
    def __init__(self, matcher: Any, reasoning_start_token_id: int | None,
                 reasoning_end_token_id: int | None, prompt_token_ids: list[int]) -> None:
        self.matcher = matcher
        self.reasoning_start_token_id = reasoning_start_token_id
        self.reasoning_end_token_id = reasoning_end_token_id
        # A prompt that already closes the block (thinking disabled: the template ends it
        # with `<think></think>`) leaves no reasoning to wait for.
        closed = bool(prompt_token_ids) and prompt_token_ids[-1] == reasoning_end_token_id
        self.state: State = "constrained" if reasoning_end_token_id is None or closed \
            else "opening"

    @property
    def active(self) -> bool:
        """Whether this step's token is masked (the grammar's tokens, and at the opening the
        reasoning start token too)."""
        return self.state != "reasoning"

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.state == "opening" and self.reasoning_start_token_id is not None:
            word, bit = divmod(self.reasoning_start_token_id, 32)
            value = int(bitmask[row, word]) | (1 << bit)
            bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32

    def accept_token(self, token_id: int) -> None:
        """Advance past a sampled token (which the mask of its step allowed)."""
        if self.state == "opening":
            if token_id == self.reasoning_start_token_id:
                self.state = "reasoning"
                return
            self.state = "constrained"
        if self.state == "constrained":
            self.matcher.accept_token(token_id)
        elif token_id == self.reasoning_end_token_id:
            self.state = "constrained"

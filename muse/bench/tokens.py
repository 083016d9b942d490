"""Counting tokens of synthetic text, and cutting text to a token budget.

The server's own `/tokenize` (muse and vLLM have one) gives exact counts for the model under
test; without it a characters-per-token ratio stands in, and the trace records which was used.
"""

from __future__ import annotations

import logging
import random
from typing import Protocol

import httpx

from muse.bench.text import TextSource

logger = logging.getLogger("muse.bench")

DEFAULT_CHARS_PER_TOKEN = 4.0
# Cutting stops once a piece is within this share of its budget (or one token of it).
TOLERANCE = 0.005
MAX_FIT_ROUNDS = 8


class TokenCounter(Protocol):
    description: str

    def count(self, text: str) -> int: ...


class CharsPerToken:
    """An estimate for servers without `/tokenize`."""

    def __init__(self, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN) -> None:
        if chars_per_token <= 0:
            raise ValueError(f"--chars-per-token must be positive, got {chars_per_token}")
        self.chars_per_token = chars_per_token
        self.description = f"estimate: {chars_per_token:g} characters per token"

    def count(self, text: str) -> int:
        return round(len(text) / self.chars_per_token)


class ServerTokenizer:
    """Exact counts from the server's `/tokenize`, special tokens (BOS) left out."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=120.0)
        self.model = model
        self.description = f"server: {base_url}/tokenize"

    def count(self, text: str) -> int:
        response = self.http.post("/tokenize", json={"model": self.model, "prompt": text,
                                                      "add_special_tokens": False})
        response.raise_for_status()
        body = response.json()
        return body["count"] if "count" in body else len(body["tokens"])


def server_tokenizer(base_url: str, model: str, headers: dict[str, str]
                     ) -> ServerTokenizer | None:
    """The server's tokenizer if its `/tokenize` answers, else None."""
    counter = ServerTokenizer(base_url, model, headers)
    try:
        counter.count("hello world")
    except (httpx.HTTPError, KeyError, ValueError) as error:
        logger.warning("%s/tokenize is not usable (%s); sizing text by an estimate",
                       base_url, error)
        return None
    return counter


def take(source: TextSource, seed: str, num_chars: int) -> str:
    """The first `num_chars` characters of a seeded source."""
    if num_chars <= 0:
        return ""
    pieces, length = [], 0
    for piece in source(random.Random(seed)):
        pieces.append(piece)
        length += len(piece)
        if length >= num_chars:
            break
    return "".join(pieces)[:num_chars]


class Sizer:
    """Cuts seeded sources to token budgets, learning each source's characters per token.

    A learned ratio makes the first guess land close, so most pieces cost one or two counts.
    """

    def __init__(self, counter: TokenCounter) -> None:
        self.counter = counter
        self.chars_per_token: dict[str, float] = {}

    def fit(self, source: TextSource, seed: str, num_tokens: int, head: str = "",
            tail: str = "") -> str:
        """`head`, as much of the source as makes `num_tokens` tokens in all, then `tail`."""
        if num_tokens <= 0:
            return head + tail
        ratio = self.chars_per_token.get(source.__name__, DEFAULT_CHARS_PER_TOKEN)
        tolerance = max(1, round(num_tokens * TOLERANCE))
        best, best_error = head + tail, num_tokens
        num_chars = max(1, round(num_tokens * ratio))
        tried = {num_chars}
        for _ in range(MAX_FIT_ROUNDS):
            text = head + take(source, seed, num_chars - len(head) - len(tail)) + tail
            count = self.counter.count(text)
            if count > 0:
                ratio = len(text) / count
                self.chars_per_token[source.__name__] = ratio
            if abs(count - num_tokens) < best_error:
                best, best_error = text, abs(count - num_tokens)
            if best_error <= tolerance:
                break
            step = round((num_tokens - count) * ratio) or (1 if num_tokens > count else -1)
            num_chars = max(1, num_chars + step)
            if num_chars in tried:
                break
            tried.add(num_chars)
        return best

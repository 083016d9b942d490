"""Prompt-lookup drafts: the vectorised search equals a plain scan of every earlier match."""

from __future__ import annotations

import random

from muse.speculative.ngram import WINDOW, propose_ngram


def scan(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out: for n from max_n down, the latest earlier occurrence of the last
    n tokens followed by a full draft, else the latest of those followed by the most."""
    tail = tokens[-WINDOW:]
    length = len(tail)
    if num_drafts <= 0 or length < 2:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        best: list[int] | None = None
        for end in range(length - 2, n - 2, -1):  # latest first, never the last token
            if tail[end + 1 - n:end + 1] == tail[length - n:]:
                follow = tail[end + 1:end + 1 + num_drafts]
                if len(follow) == num_drafts:
                    return follow
                if best is None or len(follow) > len(best):
                    best = follow
        if best is not None:
            return best
    return []


def test_drafts_equal_the_plain_scan():
    rng = random.Random(0)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 50])  # small vocabularies: many repeats and self-overlaps
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        args = (rng.randint(0, 8), rng.randint(1, 3), rng.randint(1, 5))
        assert propose_ngram(tokens, *args) == scan(tokens, *args), (tokens, args)


def test_the_latest_full_continuation_wins():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [7, 8]
    assert propose_ngram(tokens, 0, 1, 3) == []
    assert propose_ngram([4, 5, 6], 3, 1, 3) == []  # the last token never occurred before

"""Prompt-lookup drafts (`method: "ngram"`): where the sequence's last n tokens occurred
before, propose the tokens that followed them there.

n runs from `prompt_lookup_max` down to `prompt_lookup_min`; the latest earlier occurrence
followed by a full draft wins (recent context repeats best in agentic loops and edits), else
the one followed by the most tokens. The search looks at the last
`WINDOW` tokens only, so a step costs the same at any context length, and it starts from the
positions holding the last token (one vectorised comparison) instead of every position.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Tokens searched back from the end: long enough for a tool result or a file being edited.
WINDOW = 4096


def propose_ngram(tokens: Sequence[int], num_drafts: int, min_n: int, max_n: int
                  ) -> list[int]:
    """Up to `num_drafts` tokens that followed the latest earlier match of the last n tokens
    (largest n first); [] when nothing matches."""
    if num_drafts <= 0 or len(tokens) < 2:
        return []
    tail = np.asarray(tokens[-WINDOW:], dtype=np.int64)
    length = len(tail)
    # Ends of earlier occurrences of the last token, latest first (not the last one itself).
    ends = np.flatnonzero(tail[:-1] == tail[-1])[::-1]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        candidates = ends[ends + 1 >= n]
        if not len(candidates):
            continue
        # Each candidate's last n tokens, compared with the sequence's at once.
        windows = tail[candidates[:, None] - (n - 1) + np.arange(n)]
        matched = candidates[(windows == tail[length - n:]).all(axis=1)]
        if not len(matched):
            continue
        # A match close to the end has few tokens after it (a run repeating itself matches
        # itself shifted by one): the latest match with a full continuation wins, else the
        # latest of those with the most tokens after them.
        follow = np.minimum(length - 1 - matched, num_drafts)
        end = matched[np.argmax(follow)]
        return tail[end + 1:end + 1 + follow.max()].tolist()
    return []

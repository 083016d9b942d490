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
        pattern = tail[length - n:]
        best = None
        for end in ends:
            if end + 1 >= n and np.array_equal(tail[end + 1 - n:end + 1], pattern):
                follow = tail[end + 1:end + 1 + num_drafts]
                if len(follow) == num_drafts:
                    return follow.tolist()
                # A match close to the end has few tokens after it (a run repeating itself
                # matches itself shifted by one): keep looking for a full continuation.
                if best is None or len(follow) > len(best):
                    best = follow
        if best is not None:
            return best.tolist()
    return []

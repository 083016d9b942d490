"""The train / held-out partition: decided by a hash of an example's key, not by sampling.

Training generators skip held-out keys and evaluation draws only held-out keys, so the two
never overlap, whatever seeds or run lengths are used, and the split is the same on every
machine (keys are problem statements or paths relative to their source root).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

HELD_OUT_PERCENT = 5
TRAIN = "train"
HELD_OUT = "held_out"
SPLITS = (TRAIN, HELD_OUT)
# Far more than any generator needs (a held-out draw succeeds 1 time in 20); reaching it
# means the generator's space has no example of the split at all.
MAX_DRAWS = 100_000

Example = TypeVar("Example")


def is_held_out(key: str) -> bool:
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < HELD_OUT_PERCENT


def in_split(key: str, split: str) -> bool:
    """Whether the example with this key belongs to `split` (one of SPLITS)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return is_held_out(key) == (split == HELD_OUT)


def draw_from_split(draw: Callable[[], Example], key: Callable[[Example], str],
                    split: str) -> Example:
    """Call `draw` until its example belongs to `split`."""
    for _ in range(MAX_DRAWS):
        example = draw()
        if in_split(key(example), split):
            return example
    raise LookupError(f"no {split} example found in {MAX_DRAWS} draws")

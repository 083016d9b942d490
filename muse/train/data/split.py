"""The train / held-out partition: decided by a hash of an example's key, not by sampling.

Training generators skip held-out keys and evaluation draws only held-out keys, so the two
never overlap, whatever seeds or run lengths are used, and the split is the same on every
machine (keys are problem statements or paths relative to their source root).
"""

from __future__ import annotations

import functools
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
# Phrasings and name vocabularies are short lists, so a hash threshold could hold out none of
# them; they are split by hash rank instead, this share (at least one item) held out.
HELD_OUT_ITEM_SHARE = 0.2

Example = TypeVar("Example")


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()


def is_held_out(key: str) -> bool:
    return int.from_bytes(_digest(key), "big") % 100 < HELD_OUT_PERCENT


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


@functools.cache
def split_items(items: tuple[str, ...], split: str) -> tuple[str, ...]:
    """The items of a short list (question phrasings, name vocabularies) that belong to `split`.

    The HELD_OUT_ITEM_SHARE of the items with the lowest hashes are held out, at least one and
    never all, so evaluation asks in phrasings and uses names that training never showed.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if len(set(items)) != len(items) or len(items) < 2:
        raise ValueError(f"items must be at least 2 distinct strings, got {items!r}")
    held_out_count = max(1, round(len(items) * HELD_OUT_ITEM_SHARE))
    held_out = set(sorted(items, key=_digest)[:held_out_count])
    return tuple(item for item in items if (item in held_out) == (split == HELD_OUT))

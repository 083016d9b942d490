"""Prefix-cache block keys: SHA-256 chained over a request's full blocks.

A block's key hashes its parent's key, its token ids and its extra keys, so one key names a
whole prefix. Keys are bytes computed the same way in every process and on every machine (no
Python `hash()`, which is salted per process and predictable enough to force collisions), so
another process, a host tier or a disk tier can look a prefix up by them.

Extra keys separate prefixes whose token ids agree but whose KV must not be shared:
- the content hashes of the media items whose placeholder tokens meet the block (the
  placeholders are the same ids for any picture);
- in the first block only (the chain carries them to every later block): the request's
  `cache_salt` (vLLM's field: tenants with different salts never share a prefix) and its
  LoRA adapter's id.

SHA-256 costs about a microsecond for a 16-token block here (hashlib is C); the Python
around it costs more, so a faster non-cryptographic hash would not pay for its dependency.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockKey = bytes
# The parent of a request's first block.
ROOT_KEY = bytes(32)


def first_block_extra_keys(cache_salt: str | None = None, adapter_id: str | None = None
                           ) -> tuple[str, ...]:
    """The extra keys every block of a request inherits through its first block."""
    extra = []
    if cache_salt is not None:
        extra.append(f"salt:{cache_salt}")
    if adapter_id is not None:
        extra.append(f"adapter:{adapter_id}")
    return tuple(extra)


def media_extra_keys(content_hashes: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"media:{content_hash}" for content_hash in content_hashes)


def prompt_block_keys(token_ids: Sequence[int], block_size: int,
                      cache_salt: str | None = None) -> list[BlockKey]:
    """The keys of a text prompt's full blocks that a prefix-cache hit may cover (those
    within its first len - 1 tokens: one token is always computed)."""
    keys: list[BlockKey] = []
    for index in range((len(token_ids) - 1) // block_size):
        extra = first_block_extra_keys(cache_salt) if index == 0 else ()
        keys.append(block_key(keys[-1] if keys else None,
                              token_ids[index * block_size:(index + 1) * block_size], extra))
    return keys


def block_key(parent: BlockKey | None, token_ids: Sequence[int],
              extra_keys: Sequence[str] = ()) -> BlockKey:
    """The key of a block holding `token_ids` after the prefix `parent` names (None for a
    request's first block)."""
    tokens = array("I", token_ids)  # token ids are below 2**32
    if sys.byteorder == "big":
        tokens.byteswap()  # little-endian on every machine
    digest = hashlib.sha256(parent or ROOT_KEY)
    digest.update(len(tokens).to_bytes(4, "little"))
    digest.update(tokens.tobytes())
    for extra in extra_keys:  # each length-prefixed, so no two lists encode alike
        encoded = extra.encode()
        digest.update(len(encoded).to_bytes(4, "little"))
        digest.update(encoded)
    return digest.digest()

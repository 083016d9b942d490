"""Prefix-cache keys: stable across processes, separated by salt, adapter and media."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

from muse import SamplingParams
from muse.engine.kv_cache import KVCacheManager
from muse.engine.prefix_keys import block_key, first_block_extra_keys, media_extra_keys
from muse.engine.request import Request
from tests.engine.helpers import random_prompt, tiny_llm

PROMPT = random_prompt(70, 3)
KEYS_SCRIPT = """
from muse import SamplingParams
from muse.engine.kv_cache import KVCacheManager
from muse.engine.request import Request
manager = KVCacheManager(16, {"full_attention": 64}, None)
request = Request("r", %r, SamplingParams(), cache_salt="tenant")
manager.find_cached_prefix(request)
print(" ".join(key.hex() for key in manager.requests["r"].keys))
"""


def request_keys(prompt: list[int], **fields) -> list[bytes]:
    manager = KVCacheManager(16, {"full_attention": 64}, None)
    request = Request("r", prompt, SamplingParams(), **fields)
    manager.find_cached_prefix(request)
    return manager.requests["r"].keys


def test_the_same_prompt_has_the_same_keys_in_processes_with_other_hash_seeds():
    printed = set()
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run([sys.executable, "-c", KEYS_SCRIPT % (PROMPT,)], env=env,
                                capture_output=True, text=True, check=True)
        printed.add(result.stdout.strip())
    assert len(printed) == 1
    assert printed.pop().split() == [key.hex() for key in request_keys(PROMPT,
                                                                         cache_salt="tenant")]


def test_a_key_is_sha256_of_its_parent_tokens_and_extra_keys():
    # Pinned bytes: a change of the format breaks every stored tier and must be deliberate.
    key = block_key(None, [1, 2, 3])
    assert key.hex() == "fa1108a634d8d464cee58a11438e2080d0be0dc0f811e9bc838e92ca3a69cc4a"
    assert key == hashlib.sha256(bytes(32) + struct.pack("<I3I", 3, 1, 2, 3)).digest()
    assert block_key(key, [4]) != block_key(None, [4])  # the parent is part of the key
    assert block_key(None, [1, 2]) != block_key(None, [1, 2, 0])
    # Extra keys are length-prefixed: no two lists of them encode alike.
    assert block_key(None, [1], ["ab", "c"]) != block_key(None, [1], ["a", "bc"])
    assert block_key(None, [1], media_extra_keys(["x"])) != block_key(None, [1])


def test_salt_adapter_and_media_separate_otherwise_equal_prefixes():
    plain = request_keys(PROMPT)
    assert len(plain) == 4
    salted = request_keys(PROMPT, cache_salt="a")
    assert salted == request_keys(PROMPT, cache_salt="a")
    assert all(x != y for x, y in zip(plain, salted))  # the first block's salt reaches all
    assert all(x != y for x, y in zip(salted, request_keys(PROMPT, cache_salt="b")))
    assert first_block_extra_keys(adapter_id="7") != first_block_extra_keys(cache_salt="7")
    assert first_block_extra_keys() == ()


def test_the_engine_shares_prefixes_only_within_a_salt():
    llm = tiny_llm()
    params = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(**fields) -> int:
        (output,) = llm.generate([{"prompt_token_ids": PROMPT, **fields}], params,
                                 use_tqdm=False)
        return output.num_cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="b") == 0
    assert cached() == 0
    assert cached(cache_salt="a") == 64
    assert cached() == 64
    llm.reset_prefix_cache()
    assert cached(cache_salt="a") == 0

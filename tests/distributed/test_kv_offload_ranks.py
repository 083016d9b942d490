"""The host-memory and disk KV tiers with two tensor-parallel ranks (CPU, gloo): each rank
saves and loads its own K/V heads, and a restarted engine reloads both ranks' files."""

from __future__ import annotations

from pathlib import Path

from muse import LLM
from muse.engine.kv_offload import DISK, HOST
from tests.engine.helpers import assert_same_outputs, random_prompt
from tests.engine.test_kv_offload import PROMPT, generate, tiers, tiny_block_set_bytes

OTHERS = [random_prompt(70, seed) for seed in range(2, 10)]


def tp2_llm(**args) -> LLM:
    return LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
               tensor_parallel_size=2, **args)


def test_two_ranks_reload_their_shards_from_host_memory_and_disk(tmp_path: Path):
    want = generate(LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
                        enable_prefix_caching=False), PROMPT)
    # A rank holds one of the two K/V heads: half a block set. 12 GPU blocks a kind (PROMPT
    # and each other prompt take 5), 16 host slots (4 full blocks a prompt).
    args = tiers(tiny_block_set_bytes() // 2, 16, kv_offload_disk=str(tmp_path))
    args["kv_cache_memory_bytes"] //= 2
    llm = tp2_llm(**args)
    try:
        first = generate(llm, PROMPT)
        for prompt in OTHERS[:3]:  # out of the GPU pools, not out of host memory
            generate(llm, prompt)
        hit = generate(llm, PROMPT)
        assert hit.num_cached_tokens == 64
        assert llm.engine.kv_cache.offload.stats.hit_tokens[HOST] == 64
        for prompt in OTHERS[3:]:  # out of host memory too: on disk
            generate(llm, prompt)
    finally:
        llm.shutdown()
    shards = {path.name.split(".")[1] for path in tmp_path.rglob("*.kv")}
    assert shards == {"pp0-tp0", "pp0-tp1"}
    restarted = tp2_llm(**args)
    try:
        again = generate(restarted, PROMPT)
        assert again.num_cached_tokens == 64
        assert restarted.engine.kv_cache.offload.stats.hit_tokens[DISK] == 64
    finally:
        restarted.shutdown()
    assert_same_outputs([first, hit, again], [want, want, want])

"""Block pools, the prefix cache's reuse rule for sliding layers, and block accounting in a run."""

import itertools
from collections import Counter

import pytest
import torch

from muse import SamplingParams
from muse.config import FULL, SLIDING
from muse.engine.kv_budget import block_bytes
from muse.engine.block_pool import NULL_BLOCK, BlockPool
from muse.engine.kv_cache import KVCacheGroup, KVCacheManager
from muse.engine.request import Request, RequestStatus
from muse.presets import get_preset
from tests.engine.helpers import (assert_greedy_is_well_defined, assert_same_outputs,
                                  random_prompt, tiny_llm)

BLOCK = 4
# 33 tokens: 8 full blocks, and a reuse point of at most 32 (one token is left to compute).
PROMPT = list(range(100, 133))
_ids = itertools.count()


def make_request(tokens, **params) -> Request:
    return Request(f"request-{next(_ids)}", list(tokens), SamplingParams(**params))


def prefill(manager: KVCacheManager, request: Request) -> int:
    """Admit `request` as the scheduler does and compute its prompt in one chunk."""
    cached = manager.find_cached_prefix(request)
    assert manager.allocate(request, request.num_tokens - cached, cached)
    request.num_computed_tokens = request.num_tokens
    manager.on_computed(request)
    return cached


def keep_only_cached(group: KVCacheGroup, keys: list) -> None:
    """Evict every cached free block of `group` except those holding `keys`."""
    pool = group.pool
    kept = [group.index.lookup(key) for key in keys]
    assert None not in kept
    for block in kept:
        pool.acquire(block)
    taken = [pool.allocate() for _ in range(pool.num_free)]  # allocation is what evicts
    for block in taken + kept:
        pool.release(block)


def cached_after_eviction(window, keep_sliding=range(8), keep_global=range(8), prompt=PROMPT,
                          kinds=(FULL, SLIDING)) -> tuple[KVCacheManager, Request, list, int]:
    """Cache PROMPT's 8 blocks, keep only some per kind, then look up `prompt`."""
    manager = KVCacheManager(BLOCK, {kind: 64 for kind in kinds}, window)
    donor = make_request(PROMPT)
    prefill(manager, donor)
    keys = list(manager.requests[donor.request_id].keys)
    assert len(keys) == 8
    manager.free(donor)
    if SLIDING in kinds:
        keep_only_cached(manager.groups[SLIDING], [keys[b] for b in keep_sliding])
    keep_only_cached(manager.groups[FULL], [keys[b] for b in keep_global])
    request = make_request(prompt)
    return manager, request, keys, manager.find_cached_prefix(request)


def assert_all_released(kv_cache: KVCacheManager) -> None:
    """Nothing is held: every block is free, cached ones only as evictable prefix cache."""
    assert kv_cache.requests == {}
    for kind, pool in kv_cache.pools.items():
        assert pool.num_used == 0, kind
        assert not any(pool.ref_counts), kind
        assert sorted(pool.free) == list(range(1, pool.num_blocks)), kind
        index = kv_cache.groups[kind].index
        assert all(index.keys[block] == key for key, block in index.blocks.items()), kind


def assert_consistent(kv_cache: KVCacheManager) -> None:
    """Reference counts are exactly the requests' block-table entries."""
    for kind, pool in kv_cache.pools.items():
        held = Counter(block for state in kv_cache.requests.values()
                       for block in state.tables[kind] if block != NULL_BLOCK)
        assert {b: pool.ref_counts[b] for b in held} == dict(held), kind
        assert sum(pool.ref_counts) == sum(held.values()), kind
        assert pool.num_used == len(held), kind
        assert not set(held) & set(pool.free), kind


# ---- the reuse rule ------------------------------------------------------------------------
@pytest.mark.parametrize("window, keep_sliding, expected", [
    (8, range(8), 32),
    # Only the window before the reuse point matters: the query at 32 sees 25..32.
    (8, [6, 7], 32),
    (8, [0, 1, 2, 3, 5, 6], 28),  # 7 evicted: at 28 the window needs blocks 5 and 6
    (8, range(6), 24),  # 6 and 7 evicted
    (8, [0, 1, 2, 3], 16),
    (8, [7], 0),  # every earlier reuse point needs a block that is gone
    (8, [], 0),
    # A window smaller than a block: the query at 32 sees 30..32, all in block 7.
    (3, [7], 32),
    (3, [6], 28),
    (3, [], 0),
    (1, [], 32),  # a window of one token needs no earlier key at all
    # Windows that are not a multiple of the block size.
    (5, [7], 32),  # 28..32: block 7 only
    (6, [7], 0),  # 27..32 reaches into block 6
    (6, [5, 6], 28),
    (6, [1, 2, 3], 16),
    (10, [6, 7], 0),  # the query at 32 sees 23..32, so block 5 is needed too
    (10, [5, 6, 7], 32),
    (2, [7], 32),
    (2, [6], 28),
    (13, [4, 5, 6, 7], 32),  # 20..32: blocks 5 to 7
    (13, [5, 6, 7], 32),
    (13, [4, 5, 6], 28),  # at 32 the window needs blocks 5 to 7, at 28 blocks 4 to 6
])
def test_sliding_layers_limit_the_reuse_point(window, keep_sliding, expected):
    # The global layers keep all 8 blocks, so any shortfall below 32 is the sliding rule's.
    _, _, _, cached = cached_after_eviction(window, keep_sliding)
    assert cached == expected


def test_global_hit_shorter_than_sliding_hit():
    # Block 3 evicted from the global pool: reuse stops at 12, which the sliding window allows.
    _, _, _, cached = cached_after_eviction(8, keep_global=[0, 1, 2, 4, 5, 6, 7])
    assert cached == 12
    _, _, _, cached = cached_after_eviction(8, keep_sliding=[0, 1, 2, 3, 4, 5],
                                            keep_global=[0, 1, 2, 3, 4])
    assert cached == 20


def test_reuse_point_is_capped_below_the_prompt_length():
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:32])  # all 8 blocks cached
    assert cached == 28  # (32 - 1) rounded down to a block
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:30])
    assert cached == 28
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:29])
    assert cached == 28
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:28])
    assert cached == 24
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:4])
    assert cached == 0
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT + [7, 7, 7])
    assert cached == 32
    # A different token inside block 5 ends the shared prefix there.
    _, _, _, cached = cached_after_eviction(8, prompt=PROMPT[:22] + [9] + PROMPT[23:])
    assert cached == 20


def test_a_model_with_only_global_layers():
    _, _, _, cached = cached_after_eviction(None, kinds=(FULL,))
    assert cached == 32
    _, _, _, cached = cached_after_eviction(None, keep_global=range(5), kinds=(FULL,))
    assert cached == 20
    _, _, _, cached = cached_after_eviction(8, keep_global=[1, 2, 3], kinds=(FULL,))
    assert cached == 0


def test_no_reuse_for_prompt_logprobs_or_when_disabled():
    manager, _, _, cached = cached_after_eviction(8)
    assert cached == 32
    assert manager.find_cached_prefix(make_request(PROMPT, prompt_logprobs=1)) == 0
    disabled = KVCacheManager(BLOCK, {FULL: 64, SLIDING: 64}, 8, enable_prefix_caching=False)
    prefill(disabled, make_request(PROMPT))
    assert disabled.find_cached_prefix(make_request(PROMPT)) == 0


def test_allocation_after_a_hit_reuses_exactly_the_needed_blocks():
    manager, request, keys, cached = cached_after_eviction(8, keep_sliding=range(6))
    assert cached == 24
    sliding, full = manager.pools[SLIDING], manager.pools[FULL]
    sliding_index = manager.groups[SLIDING].index
    cached_sliding = [sliding_index.lookup(keys[b]) for b in (4, 5)]
    cached_full = [manager.groups[FULL].index.lookup(keys[b]) for b in range(6)]
    assert manager.allocate(request, request.num_tokens - cached, cached)
    tables = manager.block_tables(request)
    # The query at 24 sees 17..24: sliding blocks before 4 are not needed and stay null.
    assert tables[SLIDING][:4] == [NULL_BLOCK] * 4
    assert tables[SLIDING][4:6] == cached_sliding
    assert tables[FULL][:6] == cached_full
    assert len(tables[SLIDING]) == len(tables[FULL]) == 9  # ceil(33 / 4)
    fresh = tables[FULL][6:] + tables[SLIDING][6:]
    assert NULL_BLOCK not in fresh
    assert all(pool.ref_counts[b] == 1 for pool, table in ((full, tables[FULL]),
                                                             (sliding, tables[SLIDING]))
               for b in table if b != NULL_BLOCK)
    assert manager.num_held_blocks(request, SLIDING) == 5
    assert manager.num_held_blocks(request, FULL) == 9
    # Evicted blocks were not revived: their keys are still unknown.
    assert sliding_index.lookup(keys[6]) is None and sliding_index.lookup(keys[7]) is None
    request.num_computed_tokens = request.num_tokens
    manager.on_computed(request)
    assert_consistent(manager)
    # The new computation re-registers the blocks the sliding pool had lost.
    assert sliding_index.lookup(keys[7]) is not None
    manager.free(request)
    assert_all_released(manager)


# ---- the free list and eviction --------------------------------------------------------------
def test_free_list_order_is_release_order_and_allocation_evicts():
    group = KVCacheGroup(FULL, 6)
    pool, index = group.pool, group.index
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (1, 2, 3)
    key_a, key_b = b"a" * 32, b"b" * 32
    assert index.register(a, key_a) and index.register(b, key_b)
    assert not index.register(c, key_a)  # a duplicate stays private
    assert pool.num_used == 3 and pool.num_free == 2
    pool.release(b)
    pool.release(a)
    pool.release(c)  # uncached
    # Cached free blocks count as free: nobody holds them.
    assert pool.num_used == 0 and pool.num_free == 5
    assert index.lookup(key_a) == a and index.lookup(key_b) == b
    # Never used blocks go first, then released ones, oldest release first.
    assert [pool.allocate(), pool.allocate()] == [4, 5]
    assert index.lookup(key_b) == b
    assert pool.allocate() == b
    assert index.lookup(key_b) is None and b not in index.keys
    assert index.lookup(key_a) == a
    assert pool.allocate() == a
    assert index.lookup(key_a) is None and len(index) == 0
    assert pool.allocate() == c
    assert pool.num_free == 0


def test_reviving_a_cached_block_makes_it_most_recently_used():
    group = KVCacheGroup(FULL, 4)
    pool, index = group.pool, group.index
    blocks = [pool.allocate() for _ in range(3)]
    keys = [bytes([n]) * 32 for n in range(3)]
    for block, key in zip(blocks, keys):
        index.register(block, key)
    for block in blocks:
        pool.release(block)
    pool.acquire(index.lookup(keys[0]))
    assert pool.ref_counts[blocks[0]] == 1 and blocks[0] not in pool.free
    pool.acquire(blocks[0])  # a second holder
    pool.release(blocks[0])
    assert blocks[0] not in pool.free
    pool.release(blocks[0])
    assert list(pool.free) == [blocks[1], blocks[2], blocks[0]]
    assert pool.allocate() == blocks[1]
    assert index.lookup(keys[1]) is None
    assert index.lookup(keys[0]) == blocks[0]


def test_a_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_freeing_a_request_evicts_its_tail_first():
    # 13 tokens: 3 full blocks and one partial, in a pool of exactly 4 usable blocks.
    manager = KVCacheManager(BLOCK, {FULL: 5}, None)
    prompt = list(range(50, 63))
    first = make_request(prompt)
    prefill(manager, first)
    keys = list(manager.requests[first.request_id].keys)
    manager.free(first)
    pool, index = manager.groups[FULL].pool, manager.groups[FULL].index
    assert [index.lookup(key) is not None for key in keys] == [True, True, True]
    # Two allocations evict the partial (uncached) block, then the last full block.
    pool.release(pool.allocate())
    assert [index.lookup(key) is not None for key in keys] == [True, True, True]
    pool.allocate()
    assert [index.lookup(key) is not None for key in keys] == [True, True, False]
    assert manager.find_cached_prefix(make_request(prompt)) == 8


def test_concurrent_duplicates_keep_the_first_copy_cached():
    manager = KVCacheManager(BLOCK, {FULL: 32, SLIDING: 32}, 8)
    first, second = make_request(PROMPT), make_request(PROMPT)
    for request in (first, second):  # both admitted before either computed anything
        assert manager.find_cached_prefix(request) == 0
        assert manager.allocate(request, request.num_tokens)
    for request in (first, second):
        request.num_computed_tokens = request.num_tokens
        manager.on_computed(request)
    keys = manager.requests[first.request_id].keys
    full = manager.groups[FULL].index
    first_table = list(manager.block_tables(first)[FULL])
    second_table = list(manager.block_tables(second)[FULL])
    assert [full.lookup(key) for key in keys] == first_table[:8]
    assert all(block not in full.keys for block in second_table)
    manager.free(first)
    manager.free(second)
    assert_all_released(manager)
    assert manager.find_cached_prefix(make_request(PROMPT)) == 32


# ---- through the engine ----------------------------------------------------------------------
def test_hit_rate_counters():
    llm = tiny_llm()
    stats = llm.engine.kv_cache.stats
    prompt = random_prompt(40, 0)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert (stats.queries, stats.hits, first.num_cached_tokens) == (40, 0, 0)
    second = llm.generate([prompt], params)[0]
    # (40 - 1) rounded down to the block size of 16
    assert (stats.queries, stats.hits, second.num_cached_tokens) == (80, 32, 32)
    assert stats.hit_rate == pytest.approx(32 / 80)
    assert_same_outputs([second], [first])
    assert_greedy_is_well_defined(llm, [prompt], [first.outputs[0].token_ids])
    other = llm.generate([prompt[:20] + random_prompt(20, 1)], params)[0]
    assert (stats.queries, stats.hits, other.num_cached_tokens) == (120, 48, 16)
    assert_all_released(llm.engine.kv_cache)


def test_every_block_is_released_after_generate():
    llm = tiny_llm(max_num_batched_tokens=32)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 17, 40, 70, 33))]
    prompts.append(prompts[3][:50] + random_prompt(9, 9))  # shares a prefix with another
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, logit_bias={2: 100.0}),  # eos
              SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.0, n=2, max_tokens=5, prompt_logprobs=2,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs) for o in outputs] == [1, 3, 1, 1, 2, 1]
    assert [len(c.token_ids) for o in outputs for c in o.outputs] == [9, 7, 7, 7, 1, 12, 5, 5, 3]
    kv_cache = llm.engine.kv_cache
    assert any(group.index for group in kv_cache.groups.values())
    assert_all_released(kv_cache)
    assert not llm.engine.has_unfinished()


def test_every_block_is_released_after_aborts():
    llm = tiny_llm(max_num_batched_tokens=32)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("long", random_prompt(45, 0), params)
    engine.add_request("group", random_prompt(35, 1),
                       SamplingParams(temperature=1.0, n=3, max_tokens=50, ignore_eos=True))
    engine.add_request("short", random_prompt(10, 2), params)
    for _ in range(4):
        engine.step()
        assert_consistent(engine.kv_cache)
    assert sum(pool.num_used for pool in engine.kv_cache.pools.values()) > 0
    # The group's later samples already share the first one's prompt blocks.
    assert [r.status for r in engine.requests["group"]] == [RequestStatus.RUNNING] * 3
    engine.add_request("waiting", random_prompt(30, 3), params)  # never scheduled
    for request_id in ("group", "long", "waiting", "short"):
        engine.abort(request_id)
        assert_consistent(engine.kv_cache)
    assert_all_released(engine.kv_cache)
    assert not engine.has_unfinished()
    assert engine.scheduler.num_unfinished == 0
    assert engine.step() == []


def test_sliding_blocks_stay_bounded_on_a_long_request():
    llm = tiny_llm(max_num_batched_tokens=32)
    engine, kv_cache = llm.engine, llm.engine.kv_cache
    window, block = engine.config.sliding_window, engine.args.block_size
    prompt = random_prompt(10 * window, 4)
    request, = engine.add_request("long", prompt,
                                  SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    global_counts = []
    while engine.has_unfinished():
        engine.step()
        if request.is_finished:
            break
        sliding = kv_cache.num_held_blocks(request, SLIDING)
        assert 1 <= sliding <= window // block + 2, request.num_computed_tokens
        assert kv_cache.pools[SLIDING].num_used == sliding
        global_held = kv_cache.num_held_blocks(request, FULL)
        assert global_held == -(-request.num_computed_tokens // block)
        global_counts.append(global_held)
        assert_consistent(kv_cache)
    assert len(request.output_token_ids) == 40
    assert global_counts == sorted(global_counts)
    # The last step before the finishing one had computed the prompt and 38 output tokens.
    assert global_counts[0] == 2 and global_counts[-1] == -(-(len(prompt) + 38) // block)
    assert_all_released(kv_cache)


@pytest.mark.parametrize("block_size", [7, 32])
def test_prefix_reuse_with_odd_block_sizes_keeps_greedy_output(block_size):
    # The window (16) is not a multiple of 7, and is smaller than 32.
    shared = random_prompt(45, 10)
    prompts = [shared + random_prompt(length, 20 + length) for length in (3, 9, 20)]
    prompts.append(shared)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    want = tiny_llm(enable_prefix_caching=False).generate(prompts, params)
    llm = tiny_llm(block_size=block_size, max_num_batched_tokens=24)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    assert_same_outputs(first, want)
    assert_same_outputs(second, want)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert_greedy_is_well_defined(llm, prompts, [o.outputs[0].token_ids for o in want])
    assert_all_released(llm.engine.kv_cache)


def test_preemption_returns_blocks_and_keeps_greedy_output():
    prompts = [random_prompt(20, seed) for seed in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in tiny_llm().generate(prompts, params)]
    # 6 blocks per kind: 5 usable global blocks, while the three requests need 3 each.
    bytes_per_block = sum(block_bytes(get_preset("muse-spark-tiny").text_config, 16,
                                      torch.float32).values())
    llm = tiny_llm(max_num_seqs=4, max_num_batched_tokens=16,
                   kv_cache_memory_bytes=6 * bytes_per_block)
    engine, kv_cache = llm.engine, llm.engine.kv_cache
    assert kv_cache.pools[FULL].num_blocks == 6
    requests = [engine.add_request(str(i), prompt, params)[0] for i, prompt in enumerate(prompts)]
    preempted_seen = 0
    while engine.has_unfinished():
        before = [r.num_preemptions for r in requests]
        engine.step()
        assert_consistent(kv_cache)
        for request, count in zip(requests, before):
            if request.num_preemptions > count:
                preempted_seen += 1
                assert request.status == RequestStatus.WAITING
                assert request.num_computed_tokens == 0
                assert request.request_id not in kv_cache.requests
                assert all(kv_cache.num_held_blocks(request, kind) == 0
                           for kind in kv_cache.pools)
    assert preempted_seen > 0
    assert engine.scheduler.num_preemptions == preempted_seen
    assert [r.output_token_ids for r in requests] == want
    assert all(r.finish_reason == "length" for r in requests)
    assert_greedy_is_well_defined(llm, prompts, want)
    assert_all_released(kv_cache)

"""The per-step delta from the driver to the other ranks: each rank's mirror rebuilds exactly
the driver's `HostBatch`, while a decode step costs a few ints a request."""

from __future__ import annotations

import itertools
import pickle
import random

import pytest
import torch

from muse import SamplingParams
from muse.config import FULL, SLIDING
from muse.engine.executor import Executor, UniExecutor
from muse.engine.kv_budget import block_bytes
from muse.engine.block_pool import NULL_BLOCK
from muse.engine.kv_cache import KVCacheManager, window_start_block
from muse.engine.metadata import BatchEntry, HostBatch, build_host_batch, scheduled_entries
from muse.engine.request import Request, RequestStatus
from muse.engine.runner import ModelRunner
from muse.engine.scheduler import ScheduledRequest, Scheduler
from muse.engine.step_message import (CachedRequestData, NewRequestData, RequestMirror,
                                      StepDelta, StepEncoder, decode_delta, encode_delta)
from muse.presets import get_preset
from tests.engine.helpers import mixed_prompts, tiny_llm

KINDS = [FULL, SLIDING]
BLOCK = 4
_ids = itertools.count()


def make_request(prompt: list[int], request_id: str | None = None, **params) -> Request:
    return Request(request_id or f"r{next(_ids)}", list(prompt), SamplingParams(**params))


class FakeTables:
    """Block tables held outside a KV cache manager, for hand-made steps."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, list[int]]] = {}

    def grow(self, request: Request, num_tokens: int) -> None:
        tables = self.tables.setdefault(request.request_id, {kind: [] for kind in KINDS})
        for kind, table in tables.items():
            while len(table) * BLOCK < num_tokens:
                table.append(1000 * (KINDS.index(kind) + 1) + len(table))

    def __call__(self, request: Request) -> dict[str, list[int]]:
        return self.tables[request.request_id]


def through_bytes(encoder: StepEncoder, mirror: RequestMirror, scheduled, tables,
                  window: int | None = None) -> tuple[StepDelta, HostBatch, HostBatch]:
    """Encode a step, send it through bytes to the mirror; (delta, mirror's batch, driver's)."""
    delta = encoder.encode(scheduled, tables)
    data = encode_delta(delta)
    assert isinstance(data, bytes)
    got = build_host_batch(KINDS, BLOCK, window, mirror.apply(decode_delta(data)))
    want = build_host_batch(KINDS, BLOCK, window, scheduled_entries(scheduled, tables))
    return delta, got, want


def test_round_trip():
    delta = StepDelta([NewRequestData("a", 4, 3, [1, 2, 3, 4, 5, 6, 7], [[1, 2], [3, 0]]),
                       CachedRequestData("b", 9, 1, [42], []),
                       CachedRequestData("c", 12, 1, [], [[7], [8]])], ["d", "e"])
    data = encode_delta(delta)
    assert decode_delta(data) == delta
    assert [item.request_id for item in decode_delta(data).new] == ["a"]
    assert [item.request_id for item in decode_delta(data).cached] == ["b", "c"]


def test_new_then_cached_then_finished():
    tables, encoder, mirror = FakeTables(), StepEncoder(KINDS), RequestMirror(KINDS)
    a, b = make_request(range(10, 20)), make_request(range(30, 36))
    # Step 1: a's first chunk of 6 tokens, b whole.
    tables.grow(a, 6)
    tables.grow(b, 6)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 6),
                                                       ScheduledRequest(b, 6)], tables)
    assert got == want
    assert delta.new == [NewRequestData(a.request_id, 0, 6, list(range(10, 16)), [[1000, 1001],
                                                                                 [2000, 2001]]),
                         NewRequestData(b.request_id, 0, 6, list(range(30, 36)),
                                        [[1000, 1001], [2000, 2001]])]
    a.num_computed_tokens, b.num_computed_tokens = 6, 6
    b.append_token(99, None)
    # Step 2: b first (order is the scheduler's), decoding its sampled token; a's last chunk.
    tables.grow(a, 10)
    tables.grow(b, 7)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(b, 1),
                                                       ScheduledRequest(a, 4)], tables)
    assert got == want and got.input_ids == [99, 16, 17, 18, 19]
    assert delta.scheduled == [CachedRequestData(b.request_id, 6, 1, [99], []),
                               CachedRequestData(a.request_id, 6, 4, [16, 17, 18, 19],
                                                 [[1002], [2002]])]
    assert delta.finished == []
    # Step 3: b finished; a decodes and is the only one left in the mirror.
    a.num_computed_tokens, b.num_computed_tokens = 10, 7
    a.append_token(77, None)
    b.status = RequestStatus.FINISHED
    tables.grow(a, 11)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 1)], tables)
    assert got == want
    assert delta.finished == [b.request_id]
    assert delta.scheduled == [CachedRequestData(a.request_id, 10, 1, [77], [])]
    assert set(mirror.requests) == {a.request_id}
    # A new request reusing a finished one's id is another request: sent whole.
    a.status = RequestStatus.FINISHED
    again = make_request(range(50, 53), request_id=a.request_id)
    tables.tables.pop(a.request_id)
    tables.grow(again, 3)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(again, 3)], tables)
    assert got == want and delta.finished == []
    assert delta.new == [NewRequestData(a.request_id, 0, 3, [50, 51, 52], [[1000], [2000]])]


def test_a_preempted_request_is_dropped_then_sent_again_whole():
    tables, encoder, mirror = FakeTables(), StepEncoder(KINDS), RequestMirror(KINDS)
    a, b = make_request(range(10, 15)), make_request(range(20, 25))
    for request in (a, b):
        tables.grow(request, 5)
    through_bytes(encoder, mirror, [ScheduledRequest(a, 5), ScheduledRequest(b, 5)], tables)
    for request, token in ((a, 1), (b, 2)):
        request.num_computed_tokens = 5
        request.append_token(token, None)
    # b is preempted (its blocks freed) while a decodes: b is dropped from the mirror.
    b.num_computed_tokens, b.num_preemptions = 0, 1
    del tables.tables[b.request_id]
    tables.grow(a, 6)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 1)], tables)
    assert got == want and delta.finished == [b.request_id]
    assert set(mirror.requests) == {a.request_id}
    # It resumes with new blocks: recomputed from scratch, sent whole with its sampled token.
    a.num_computed_tokens = 6
    a.append_token(3, None)
    tables.tables[b.request_id] = {FULL: [500, 501], SLIDING: [600, 601]}
    tables.grow(a, 7)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 1),
                                                       ScheduledRequest(b, 6)], tables)
    assert got == want
    assert delta.scheduled[1] == NewRequestData(b.request_id, 0, 6, [20, 21, 22, 23, 24, 2],
                                                [[500, 501], [600, 601]])
    # Preempted and resumed within one step's reach (never seen unscheduled): sent whole too.
    b.num_computed_tokens, b.num_preemptions = 0, 2
    tables.tables[b.request_id] = {FULL: [700, 701], SLIDING: [800, 801]}
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(b, 6)], tables)
    assert got == want and isinstance(delta.scheduled[0], NewRequestData)


def test_pending_tokens_are_sent_once_known():
    """With the overlapped schedule the driver's input is 0 for a token not read back; the
    mirror gives the same, and gets the value with the next step's delta."""
    tables, encoder, mirror = FakeTables(), StepEncoder(KINDS), RequestMirror(KINDS)
    a = make_request(range(10, 14))
    tables.grow(a, 4)
    through_bytes(encoder, mirror, [ScheduledRequest(a, 4)], tables)
    a.num_computed_tokens = 4
    a.add_pending_token(1000)
    tables.grow(a, 5)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 1)], tables)
    assert got == want and got.input_ids == [0] and delta.scheduled[0].new_token_ids == []
    a.num_computed_tokens = 5
    a.add_pending_token(1000)
    a.append_token(40, None)  # the first read back once the second step is launched
    tables.grow(a, 6)
    delta, got, want = through_bytes(encoder, mirror, [ScheduledRequest(a, 1)], tables)
    assert got == want and delta.scheduled[0].new_token_ids == [40]
    assert mirror.requests[a.request_id][0] == [10, 11, 12, 13, 40]


@pytest.mark.parametrize("context", [2_000, 20_000])
def test_a_decode_step_costs_a_few_ints_a_request(context):
    block = 16
    kinds, window = [FULL, SLIDING], 128
    tables = {}
    requests = [make_request([7] * context, request_id=f"chat-{i:04d}") for i in range(8)]
    for i, request in enumerate(requests):
        # One block past the context, so the decode step does not grow the tables.
        tables[request.request_id] = {kind: list(range(i * 10_000, i * 10_000 + context
                                                       // block + 1)) for kind in kinds}
    encoder, mirror = StepEncoder(kinds), RequestMirror(kinds)

    def step(scheduled) -> tuple[bytes, HostBatch]:
        data = encode_delta(encoder.encode(scheduled, lambda r: tables[r.request_id]))
        batch = build_host_batch(kinds, block, window, mirror.apply(decode_delta(data)))
        want = build_host_batch(kinds, block, window, scheduled_entries(
            scheduled, lambda r: tables[r.request_id]))
        assert batch == want
        return data, batch

    step([ScheduledRequest(r, context) for r in requests])
    for request in requests:
        request.num_computed_tokens = context
        request.append_token(4321, None)
    data, batch = step([ScheduledRequest(r, 1) for r in requests])
    delta = decode_delta(data)
    assert all(isinstance(item, CachedRequestData) and item.new_token_ids == [4321]
               and item.new_block_ids == [] for item in delta.scheduled)
    # Per request: the tag, its id (9 characters), start, 1, one token and no blocks.
    assert len(data) <= 8 * 22 + 4
    assert len(data) * 20 < len(pickle.dumps(batch))


def test_the_decode_message_does_not_grow_with_the_context():
    sizes = []
    for context in (1_000, 60_000):
        encoder, tables = StepEncoder(KINDS), {}
        requests = [make_request([5] * context) for _ in range(8)]
        for request in requests:
            tables[request.request_id] = {kind: list(range(context // BLOCK + 1))
                                          for kind in KINDS}
        encoder.encode([ScheduledRequest(r, context) for r in requests],
                       lambda r: tables[r.request_id])
        for request in requests:
            request.num_computed_tokens = context
            request.append_token(100, None)
        sizes.append(len(encode_delta(encoder.encode(
            [ScheduledRequest(r, 1) for r in requests], lambda r: tables[r.request_id]))))
    # Only the start positions' ints may take a byte or two more.
    assert sizes[1] <= sizes[0] + 8 * 2


# ---- against the runner, in a simulated engine loop ------------------------------------------
def simulate(seed: int, overlap: bool, steps: int = 400) -> dict[str, int]:
    """Scheduler and KV cache for real, the model replaced by random tokens: each step the
    runner's batch, `build_host_batch`'s and the mirror's (through bytes) must be equal."""
    rng = random.Random(seed)
    window, max_len = 6, 200
    kv_cache = KVCacheManager(BLOCK, {FULL: 40, SLIDING: 14}, window)
    scheduler = Scheduler(kv_cache, max_num_seqs=6, max_num_batched_tokens=24)
    runner = ModelRunner(kv_cache, UniExecutor(None), torch.device("cpu"))  # never executes
    encoder, mirror = StepEncoder(KINDS), RequestMirror(KINDS)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    forks: dict[str, int] = {}  # parent id -> samples still to fork from it
    counts = dict(aborts=0, forks=0, stale=0, zeros=0, resent=0, bytes=0, pickled=0)
    ever_new: set[str] = set()
    previous: list[ScheduledRequest] = []

    def resolve(step: list[ScheduledRequest]) -> None:
        for item in step:
            request = item.request
            if request.is_finished:
                continue
            if request.num_pending_tokens:
                request.append_token(rng.randrange(1, 500), None)
            kv_cache.on_computed(request)
            if request.output_token_ids and request.num_pending_tokens == 0 \
                    and request.check_stop(max_len):
                scheduler.finish(request, RequestStatus.FINISHED, "length")

    for _ in range(steps):
        if rng.random() < 0.3:
            prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
            if rng.random() < 0.4:
                prompt = shared[:rng.randrange(8, 40)] + prompt
            request = make_request(prompt, max_tokens=rng.randrange(1, 12))
            scheduler.add(request)
            if rng.random() < 0.25:
                forks[request.request_id] = 2
        live = scheduler.running + list(scheduler.waiting)
        if live and rng.random() < 0.03:
            scheduler.finish(rng.choice(live), RequestStatus.ABORTED, "abort")
            counts["aborts"] += 1
        scheduled = scheduler.schedule().scheduled
        if scheduled:
            want = runner._host_batch(scheduled)
            assert build_host_batch(KINDS, BLOCK, window, scheduled_entries(
                scheduled, kv_cache.block_tables)) == want
            delta = encoder.encode(scheduled, kv_cache.block_tables)
            data = encode_delta(delta)
            entries = mirror.apply(decode_delta(data))
            assert build_host_batch(KINDS, BLOCK, window, entries) == want
            # The mirror holds only running requests: finished and preempted ones are gone.
            assert set(mirror.requests) <= {r.request_id for r in scheduler.running}
            counts["bytes"] += len(data)
            counts["pickled"] += len(pickle.dumps(want))
            counts["zeros"] += sum(1 for item in scheduled if item.request.num_pending_tokens)
            for item in delta.new:
                counts["resent"] += item.request_id in ever_new
                ever_new.add(item.request_id)
            for entry, item in zip(entries, scheduled):
                # Entries the driver dropped out of the window after sending them.
                driver = kv_cache.block_tables(item.request)[SLIDING]
                counts["stale"] += sum(1 for mine, theirs in zip(entry.tables[SLIDING], driver)
                                       if theirs == NULL_BLOCK != mine)
            # The engine's launch: computed tokens advance; a finished prompt samples a token.
            for item in scheduled:
                request = item.request
                request.num_computed_tokens += item.num_new_tokens
                if request.num_computed_tokens == request.num_tokens:
                    request.add_pending_token(max_len)
                    for index in range(forks.pop(request.request_id, 0)):
                        child = Request(f"{request.request_id}#{index + 1}",
                                        list(request.prompt_token_ids), request.params,
                                        parent=request)
                        shareable = (request.num_prompt_tokens - 1) // BLOCK * BLOCK
                        child.num_computed_tokens = kv_cache.fork(request, child, shareable)
                        scheduler.add(child, front=True)
                        counts["forks"] += 1
        if overlap:
            resolve(previous)
            previous = scheduled
        else:
            resolve(scheduled)
    counts["preemptions"] = scheduler.num_preemptions
    counts["hits"] = kv_cache.stats.hits
    return counts


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_mirror_rebuilds_the_runner_batch_in_random_schedules(seed, overlap):
    counts = simulate(seed, overlap)
    for what in ("aborts", "forks", "stale", "resent", "preemptions", "hits"):
        assert counts[what] > 0, f"the run had no {what}: {counts}"
    assert counts["zeros"] > 0 if overlap else counts["zeros"] == 0
    assert counts["bytes"] * 2 < counts["pickled"]


def test_build_host_batch_on_random_entries_matches_window_start_block():
    rng = random.Random(3)
    for _ in range(50):
        window = rng.choice([None, 5, 16])
        kv_cache = KVCacheManager(BLOCK, {FULL: 4, SLIDING: 4}, window)
        entries = []
        for _ in range(rng.randrange(1, 6)):
            start, n = rng.randrange(0, 60), rng.randrange(1, 10)
            # Tables may run past the step's last block: the batch stops at that block.
            tables = {kind: [rng.randrange(1, 99) for _ in range(
                -(-(start + n) // BLOCK) + rng.randrange(2))] for kind in KINDS}
            entries.append(BatchEntry([rng.randrange(99) for _ in range(n)], start, n, tables))
        batch = build_host_batch(KINDS, BLOCK, window, entries)
        assert batch.max_query_len == max(e.num_new_tokens for e in entries)
        for kind in KINDS:
            assert batch.first_blocks[kind] == [
                kv_cache.window_start_block(kind, e.start) for e in entries]
            assert batch.first_blocks[kind] == [
                window_start_block(kind, e.start, window, BLOCK) for e in entries]
        positions = [p for e in entries for p in range(e.start, e.start + e.num_new_tokens)]
        owners = [i for i, e in enumerate(entries) for _ in range(e.num_new_tokens)]
        assert batch.positions == positions and batch.token_request == owners
        for kind in KINDS:
            assert batch.tables[kind] == [
                e.tables[kind][first:-(-(e.start + e.num_new_tokens) // BLOCK)]
                for e, first in zip(entries, batch.first_blocks[kind])]
        assert batch.slots[FULL] == [entries[i].tables[FULL][p // BLOCK] * BLOCK + p % BLOCK
                                     for p, i in zip(positions, owners)]


# ---- a real engine ---------------------------------------------------------------------------
class MirrorCheckingExecutor(Executor):
    """Runs each step as the driver's executor does, after checking that the step's delta,
    through bytes, rebuilds in a mirror exactly the batch the runner built."""

    def __init__(self, llm) -> None:
        engine = llm.engine
        self.inner, self.engine = engine.runner.executor, engine
        self.kinds = list(engine.kv_cache.pools)
        self.encoder, self.mirror = StepEncoder(self.kinds), RequestMirror(self.kinds)
        self.scheduled: list[ScheduledRequest] = []
        self.steps = self.new = self.cached = self.finished = self.stale = self.pending = 0
        self.bytes = self.pickled = 0
        host_batch = engine.runner._host_batch

        def capturing_host_batch(scheduled):
            # Where the driver builds the batch: before num_computed_tokens advances.
            self.scheduled = scheduled
            return host_batch(scheduled)

        engine.runner._host_batch = capturing_host_batch
        engine.runner.executor = self

    def execute(self, batch, logits_rows, pending, previous_tokens, delta=None,
                greedy_verify=False):
        kv_cache = self.engine.kv_cache
        delta = self.encoder.encode(self.scheduled, kv_cache.block_tables)
        data = encode_delta(delta)
        entries = self.mirror.apply(decode_delta(data))
        assert build_host_batch(self.kinds, kv_cache.block_size, kv_cache.sliding_window,
                                entries) == batch
        running = {r.request_id for r in self.engine.scheduler.running}
        assert set(self.mirror.requests) <= running
        self.steps += 1
        self.bytes += len(data)
        self.pickled += len(pickle.dumps(batch))
        self.new += len(delta.new)
        self.cached += len(delta.cached)
        self.finished += len(delta.finished)
        self.pending += sum(1 for item in self.scheduled if item.request.num_pending_tokens)
        if SLIDING in self.kinds:
            for entry, item in zip(entries, self.scheduled):
                driver = kv_cache.block_tables(item.request)[SLIDING]
                self.stale += sum(1 for mine, theirs in zip(entry.tables[SLIDING], driver)
                                  if theirs == NULL_BLOCK != mine)
        return self.inner.execute(batch, logits_rows, pending, previous_tokens,
                                  greedy_verify=greedy_verify)


@pytest.mark.parametrize("overlap_schedule", [False, True])
def test_a_real_engine_step_by_step(overlap_schedule):
    """Chunked prefill, prefix-cache hits, preemption, n=2, sliding layers and an abort, each
    step's batch rebuilt by a mirror from the delta alone."""
    bytes_per_block = sum(block_bytes(get_preset("muse-spark-tiny").text_config, 16,
                                      torch.float32).values())
    llm = tiny_llm(max_num_batched_tokens=40, max_num_seqs=8,
                   kv_cache_memory_bytes=16 * bytes_per_block,
                   overlap_schedule=overlap_schedule)
    engine = llm.engine
    checker = MirrorCheckingExecutor(llm)
    assert engine.overlap_schedule == overlap_schedule
    window = engine.config.sliding_window
    prompts = mixed_prompts(engine.config.vocab_size, window, count=12, seed=4)
    for index, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=index, max_tokens=6 + index % 5,
                                ignore_eos=True, n=2 if index % 5 == 1 else 1)
        engine.add_request(f"q{index}", prompt, params)
    for _ in range(6):
        engine.step()
    engine.abort("q5")
    engine.abort("q6")  # two samples, the second forked from the first
    while engine.has_unfinished():
        engine.step()
    # A second round: prefixes the first one left in the cache.
    outputs = llm.generate(prompts[:4], SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.stats.hits > 0
    assert SLIDING in checker.kinds and checker.stale > 0
    assert checker.new > len(prompts) + 4  # forked samples and resumed requests too
    assert checker.cached > checker.new and checker.finished > 0
    assert checker.bytes * 2 < checker.pickled
    # The overlapped schedule feeds tokens not read back yet (with several ranks it is off).
    assert checker.pending > 0 if overlap_schedule else checker.pending == 0

"""`HostBatch.split` (pipeline micro-batches) and the worker's mapping of logits rows to them."""

from __future__ import annotations

import copy

import pytest
import torch

from muse.engine.metadata import HostBatch
from muse.engine.worker import ModelWorker

BLOCK = 4
KINDS = ["full_attention", "sliding_attention"]


def make_batch(lengths: list[int], seed: int = 0) -> HostBatch:
    """A step of requests computing `lengths[i]` new tokens each, after a few cached ones,
    with distinct ids, slots and tables per kind (the sliding kind starts past block 0)."""
    generator = torch.Generator().manual_seed(seed)
    batch = HostBatch(kinds=list(KINDS), max_query_len=max(lengths))
    next_block = 1
    for index, length in enumerate(lengths):
        start = int(torch.randint(0, 9, (), generator=generator))
        end = start + length
        table = list(range(next_block, next_block + -(-end // BLOCK)))
        next_block += len(table)
        batch.input_ids += torch.randint(0, 1000, (length,), generator=generator).tolist()
        batch.positions += range(start, end)
        batch.token_request += [index] * length
        batch.query_start.append(batch.query_start[-1] + length)
        batch.seq_lens.append(end)
        for offset, kind in enumerate(KINDS):
            first = min(offset, len(table) - 1)
            batch.slots[kind] += [table[p // BLOCK] * BLOCK + p % BLOCK + offset * 1000
                                  for p in range(start, end)]
            batch.first_blocks[kind].append(first)
            batch.tables[kind].append(table[first:])
    return batch


def token_counts(parts: list[tuple[HostBatch, range]]) -> list[int]:
    return [len(tokens) for _, tokens in parts]


@pytest.mark.parametrize("lengths", [[5, 1, 1, 17, 3, 2, 9], [1] * 7, [30, 1, 1, 1], [2, 40]])
@pytest.mark.parametrize("num_parts", [2, 3, 4, 8])
def test_parts_concatenate_back_to_the_batch(lengths, num_parts):
    batch = make_batch(lengths)
    parts = batch.split(num_parts)
    assert len(parts) == min(num_parts, len(lengths))
    assert [tokens.start for _, tokens in parts] == [0] + [t.stop for _, t in parts[:-1]]
    assert parts[-1][1].stop == len(batch.input_ids)
    joined = {"input_ids": [], "positions": [], "token_request": [], "seq_lens": []}
    slots, tables, first_blocks = ({kind: [] for kind in KINDS} for _ in range(3))
    requests = 0
    for part, tokens in parts:
        # Whole requests, re-based: request 0 starts the part, its tokens count from 0.
        assert part.num_requests >= 1
        assert part.query_start[0] == 0 and part.query_start[-1] == len(tokens)
        assert part.token_request == [r for r in range(part.num_requests)
                                      for _ in range(part.query_start[r + 1]
                                                     - part.query_start[r])]
        assert part.max_query_len == max(lengths[requests:requests + part.num_requests])
        assert part.input_ids == batch.input_ids[tokens.start:tokens.stop]
        joined["input_ids"] += part.input_ids
        joined["positions"] += part.positions
        joined["token_request"] += [r + requests for r in part.token_request]
        joined["seq_lens"] += part.seq_lens
        for kind in KINDS:
            slots[kind] += part.slots[kind]
            tables[kind] += part.tables[kind]
            first_blocks[kind] += part.first_blocks[kind]
        requests += part.num_requests
    assert joined == {"input_ids": batch.input_ids, "positions": batch.positions,
                      "token_request": batch.token_request, "seq_lens": batch.seq_lens}
    assert (slots, tables, first_blocks) == (batch.slots, batch.tables, batch.first_blocks)


@pytest.mark.parametrize("seed", range(20))
def test_parts_are_balanced_by_tokens(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (int(torch.randint(2, 40, (), generator=generator)),),
                            generator=generator).tolist()
    batch = make_batch(lengths, seed)
    for num_parts in (2, 3, 4):
        counts = token_counts(batch.split(num_parts))
        # Each cut is the request boundary nearest an equal share.
        assert max(counts) <= sum(lengths) / len(counts) + max(lengths), (lengths, counts)


def test_cuts_at_the_nearest_request_boundary():
    assert token_counts(make_batch([10, 1, 1, 1, 1, 10]).split(2)) == [12, 12]
    assert token_counts(make_batch([1, 1, 1, 1, 20]).split(2)) == [4, 20]
    assert token_counts(make_batch([20, 1, 1, 1, 1]).split(2)) == [20, 4]
    # Decode steps: one token a request, as even as whole requests allow.
    assert token_counts(make_batch([1] * 9).split(4)) == [2, 2, 3, 2]
    assert token_counts(make_batch([1] * 5).split(4)) == [1, 1, 2, 1]  # ties cut early
    # One huge request still leaves a request for every other part.
    assert token_counts(make_batch([100, 1, 1]).split(3)) == [100, 1, 1]
    assert token_counts(make_batch([1, 1, 100]).split(3)) == [1, 1, 100]


def test_split_is_deterministic():
    batch = make_batch([5, 1, 1, 17, 3, 2, 9])
    assert batch.split(3) == batch.split(3) == copy.deepcopy(batch).split(3)
    assert batch.split(3) == make_batch([5, 1, 1, 17, 3, 2, 9]).split(3)


@pytest.mark.parametrize(("lengths", "num_parts"), [([7], 4), ([1], 2), ([3, 4], 1)])
def test_one_part_is_the_batch_itself(lengths, num_parts):
    batch = make_batch(lengths)
    assert batch.split(num_parts) == [(batch, range(sum(lengths)))]


def test_parts_go_to_the_device():
    batch = make_batch([3, 1, 6, 2])
    (first, _), (second, tokens) = batch.split(2)
    input_ids, meta = second.to_device(torch.device("cpu"), BLOCK)
    assert input_ids.tolist() == batch.input_ids[tokens.start:tokens.stop]
    assert meta.query_start.tolist() == [0, 6, 8] and meta.max_query_len == 6
    assert meta.kinds[KINDS[0]].block_tables.shape[0] == 2


@pytest.mark.parametrize(("logits_rows", "want_rows", "want_order"), [
    # Samples alone: each request's last token, ascending; nothing to reorder.
    ([2, 3, 9, 11], [[2, 3], [5, 7]], None),
    # Prompt-logprob rows of the second micro-batch first, then the samples.
    ([5, 6, 7, 2, 9], [[2], [1, 2, 3, 5]], [1, 2, 3, 0, 4]),
    ([], [[], []], None),
    ([10, 0], [[0], [6]], [1, 0]),
])
def test_micro_batch_logits_rows(logits_rows, want_rows, want_order):
    ranges = [range(0, 4), range(4, 12)]
    rows, order = ModelWorker._micro_batch_rows(ranges, logits_rows)
    assert (rows, order) == (want_rows, want_order)
    # Concatenating each micro-batch's rows, then indexing by `order`, gives logits_rows.
    flat = [r + part.start for part, part_rows in zip(ranges, rows) for r in part_rows]
    assert [flat[i] for i in (order or range(len(flat)))] == logits_rows

"""The draft KV group and the draft graphs' inputs: drafts over paged context rows equal the
drafter's own over per-request context caches (its plain twin), for every drafter variant,
greedy and sampled."""

from __future__ import annotations

import pytest
import torch

from muse.config import FULL
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata
from muse.speculative.draft_graphs import DraftGraphs
from muse.speculative.draft_kv import DraftKV, draft_block_bytes
from tests.speculative.test_drafter import ALL_V2, DSPARK, make_drafter, sequence

BLOCK_SIZE, NUM_BLOCKS = 4, 24


def write_sequences(kv: DraftKV, drafter, rows: list[torch.Tensor]) -> list[list[int]]:
    """Write each sequence's rows [L, K*d] into blocks of a shuffled table; returns tables."""
    order = torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(3)) + 1
    tables, next_block = [], 0
    for hidden in rows:
        length = hidden.shape[0]
        count = -(-length // BLOCK_SIZE)
        table = order[next_block:next_block + count].tolist()
        next_block += count
        positions = torch.arange(length)
        slots = torch.tensor(table)[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        meta = BatchMetadata(positions=positions, token_request=torch.zeros_like(positions),
                             query_start=torch.tensor([0, length]),
                             seq_lens=torch.tensor([length]), max_query_len=length,
                             kinds={FULL: KindMetadata(slots, torch.tensor([table]),
                                                       torch.tensor([0]))},
                             block_size=BLOCK_SIZE)
        kv.write(hidden, meta)
        tables.append(table)
    return tables


@pytest.mark.parametrize("variant", [dict(), ALL_V2, DSPARK], ids=["dflash", "v2", "dspark"])
@pytest.mark.parametrize("temperature", [None, 0.0, 0.8])
def test_paged_drafts_equal_the_per_request_cache_drafts(target, variant, temperature):
    drafter = make_drafter(target, **variant)
    ids, hidden, _ = sequence(target, drafter.config, seed=2)
    anchors = [9, 17]  # two requests: prefixes of 9 and 17 committed tokens, then the anchor
    kv = DraftKV(drafter, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    # Rows past the anchor are written too (as a verify step writes its drafts') and must
    # not be seen.
    tables = write_sequences(kv, drafter, [hidden[:a + 3] for a in anchors])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    anchor_tokens, positions = ids[anchors], torch.tensor(anchors)
    paged = kv.propose(anchor_tokens, positions, padded, temperature,
                       torch.Generator().manual_seed(5))
    caches = [drafter.new_cache() for _ in anchors]
    own = drafter.propose(torch.cat([hidden[:a] for a in anchors]),
                          torch.cat([torch.arange(a) for a in anchors]), anchors, anchor_tokens,
                          positions, caches, temperature, torch.Generator().manual_seed(5))
    assert torch.equal(paged.tokens, own.tokens)
    if temperature is None:  # greedy without q: the argmax, as a temperature of 0 draws it
        assert paged.probs is None
        zero = kv.propose(anchor_tokens, positions, padded, 0.0)
        assert torch.equal(paged.tokens, zero.tokens)
    else:
        torch.testing.assert_close(paged.probs, own.probs, atol=1e-5, rtol=1e-5)
    if own.confidence is not None:
        torch.testing.assert_close(paged.confidence, own.confidence, atol=1e-5, rtol=1e-5)


def test_draft_graph_inputs_pad_the_batch_and_give_the_same_drafts(target):
    """What a replay computes, checked on any device: the bucket-padded static inputs, run
    eagerly, give the real requests the drafts of the unpadded call."""
    drafter = make_drafter(target, **DSPARK)
    ids, hidden, _ = sequence(target, drafter.config, seed=4)
    anchors = [6, 13, 20]
    kv = DraftKV(drafter, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    tables = write_sequences(kv, drafter, [hidden[:a] for a in anchors])
    graphs = DraftGraphs(kv, max_batch=8, table_width=8, device=torch.device("cpu"),
                         greedy=True)
    assert graphs.covers(3, 8) and not graphs.covers(3, 9) and not graphs.covers(9, 2)
    size = graphs.prepare(ids[anchors].tolist(), anchors, tables, [0.0, 0.0, 0.0])
    assert size == 4
    padded = graphs._propose(size)
    width = max(len(t) for t in tables)
    want = kv.propose(ids[anchors], torch.tensor(anchors),
                      torch.tensor([t + [0] * (width - len(t)) for t in tables]))
    assert torch.equal(padded.tokens[:3], want.tokens)
    torch.testing.assert_close(padded.confidence[:3], want.confidence, atol=1e-5, rtol=1e-5)


def test_a_draft_block_holds_every_layers_keys_and_values(target):
    config = make_drafter(target).config
    per_row = 2 * config.num_key_value_heads * config.head_dim * 2
    assert draft_block_bytes(config, 16, torch.bfloat16) == \
        config.num_hidden_layers * 16 * per_row

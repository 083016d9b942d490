"""The draft KV group and the draft graphs' inputs: drafts over paged context rows equal the
drafter's own over per-request context caches (its plain twin), for every drafter variant,
greedy and sampled."""

from __future__ import annotations

import copy

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
        positions = torch.arange(length, device=hidden.device)
        slots = (torch.tensor(table, device=hidden.device)[positions // BLOCK_SIZE] * BLOCK_SIZE
                 + positions % BLOCK_SIZE)
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


def compiled_twin_cases(target, kv_device: torch.device, backend: str) -> None:
    """`write` and `draft_greedily` through `DraftKV.compile(backend)` store the rows and give
    the drafts of the eager `context_rows` / `greedy_drafts`, over batches and table widths of
    several sizes, in inference mode as the engine calls them."""
    on_device = copy.deepcopy(target).to(kv_device)
    # The V2 modules (a superset of the plain backbone's code) and the shipped dspark heads:
    # each variant costs its own compilations.
    for variant in (ALL_V2, DSPARK):
        drafter = make_drafter(target, **variant)
        ids, hidden, _ = sequence(target, drafter.config, seed=6)
        drafter = drafter.to(kv_device).bind_target(on_device.model.embed_tokens,
                                                    on_device.lm_head)
        ids, hidden = ids.to(kv_device), hidden.to(kv_device)
        eager = DraftKV(drafter, NUM_BLOCKS, BLOCK_SIZE, kv_device)
        compiled = DraftKV(drafter, NUM_BLOCKS, BLOCK_SIZE, kv_device)
        assert compiled.compile(backend)
        anchors = [5, 9, 14, 20]
        with torch.inference_mode():
            tables = write_sequences(eager, drafter, [hidden[:a + 2] for a in anchors])
            assert write_sequences(compiled, drafter, [hidden[:a + 2] for a in anchors]) \
                == tables
            for (k, v), (k_twin, v_twin) in zip(compiled.pools, eager.pools):
                torch.testing.assert_close(k, k_twin, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(v, v_twin, atol=1e-5, rtol=1e-5)
            for count in (1, 2, 4, 3):
                width = max(len(t) for t in tables[:count]) + count % 2  # null-block padding
                padded = torch.tensor([t + [0] * (width - len(t)) for t in tables[:count]],
                                      device=kv_device)
                args = (ids[anchors[:count]], torch.tensor(anchors[:count], device=kv_device),
                        padded)
                assert torch.equal(compiled.draft_greedily(*args), eager.greedy_drafts(*args))


def test_compiled_store_and_drafts_equal_the_eager_ones(target):
    # aot_eager: dynamo's graph and AOT autograd's functionalized ops, without generating
    # kernels (inductor's are compared on the GPU below and in the shipped-drafter test).
    compiled_twin_cases(target, torch.device("cpu"), "aot_eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's GPU kernels")
def test_inductor_store_and_drafts_equal_the_eager_ones_on_the_gpu(target):
    compiled_twin_cases(target, torch.device("cuda"), "inductor")


def test_the_store_and_the_draft_pass_compile_as_one_graph_each(target):
    drafter = make_drafter(target, **DSPARK)
    kv = DraftKV(drafter, NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    zero = torch.zeros(3, dtype=torch.long)
    features = torch.zeros(3, drafter.config.num_target_features * drafter.config.hidden_size)
    with torch.inference_mode():
        for function, args in ((kv.greedy_drafts, (zero, zero, zero[:, None])),
                               (kv.context_rows, (features, zero))):
            explained = torch._dynamo.explain(function)(*args)
            assert (explained.graph_count, explained.graph_break_count) == (1, 0), \
                explained.break_reasons


def test_a_drafter_that_cannot_compile_stays_eager(target, caplog):
    def failing_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    kv = DraftKV(make_drafter(target, **DSPARK), NUM_BLOCKS, BLOCK_SIZE, torch.device("cpu"))
    assert not kv.compile(failing_backend)
    assert kv._draft == kv.greedy_drafts and kv._rows == kv.context_rows
    assert "stays eager" in caplog.text

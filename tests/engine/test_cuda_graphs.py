"""Decode, verify and prefill CUDA graphs: bucket choice, padded metadata, and replay equal
to eager steps."""

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.args import EngineArgs
from muse.engine.cuda_graphs import (DecodeGraphs, StepOutputs, batch_buckets, draft_widths,
                                     prefill_query_lens)
from muse.engine.metadata import HostBatch
from tests.engine.helpers import assert_greedy_is_well_defined, assert_same_outputs, mixed_prompts


def test_buckets_cover_every_batch_size():
    for largest in (1, 3, 8, 100, 256):
        buckets = batch_buckets(largest)
        assert buckets == sorted(set(buckets)) and buckets[-1] == largest
        assert all(any(b >= n for b in buckets) for n in range(1, largest + 1))


def test_prefill_lengths_pad_by_less_than_half_and_end_at_the_limit():
    lengths = prefill_query_lens(512, above=1)
    assert lengths[0] == 16 and lengths[-1] == 512 and lengths == sorted(set(lengths))
    assert all(b < 1.5 * a + 1 for a, b in zip(lengths, lengths[1:]))
    assert prefill_query_lens(300, above=8)[-2:] == [256, 300]
    assert prefill_query_lens(512, above=32)[0] == 48  # the verify graphs hold up to 32
    assert prefill_query_lens(0, above=1) == [] == prefill_query_lens(12, above=8)


def test_host_batch_pads_block_tables_with_the_null_block():
    batch = HostBatch(kinds=["full_attention"], max_query_len=1, input_ids=[5, 6],
                      positions=[3, 20], token_request=[0, 1], query_start=[0, 1, 2],
                      seq_lens=[4, 21], slots={"full_attention": [19, 36]},
                      tables={"full_attention": [[4], [7, 2]]},
                      first_blocks={"full_attention": [0, 0]})
    assert batch.is_decode and batch.num_requests == 2
    input_ids, meta = batch.to_device(torch.device("cpu"), block_size=16)
    assert input_ids.tolist() == [5, 6]
    assert meta.kinds["full_attention"].block_tables.tolist() == [[4, 0], [7, 2]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_match_eager_steps():
    prompts = mixed_prompts(8192, 16, count=12)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", enforce_eager=eager,
                  max_num_seqs=16)
        outputs[eager] = llm.generate(prompts, params)
        graphs = llm.engine.runner.executor.worker.decode_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs.replays >= 9  # every decode step after the prefill steps
    assert_same_outputs(outputs[False], outputs[True])
    assert_greedy_is_well_defined(llm, prompts, [o.outputs[0].token_ids for o in outputs[True]])


def eager_step(engine, scheduled):
    """(runner, KV caches, host batch, eager hidden states) of a scheduled step."""
    runner = engine.runner
    kv_caches = runner.executor.worker.kv_caches
    batch = runner._host_batch(scheduled)
    input_ids, meta = batch.to_device(engine.device, runner.block_size)
    with torch.inference_mode():
        return runner, kv_caches, batch, engine.model(input_ids, meta, kv_caches)


def test_padded_graph_inputs_give_the_eager_hidden_states():
    """What a replay computes, checked on any device: the bucket-padded static inputs, run
    eagerly, give the real rows the hidden states of the unpadded step (up to float rounding:
    the padded shapes change how sums are blocked)."""
    llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", device="cpu",
              enforce_eager=True, max_num_seqs=8)
    engine = llm.engine
    prompts = mixed_prompts(8192, 16, count=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    for _ in range(4):  # prefill, then a few decode steps
        engine.step()
    scheduled = engine.scheduler.schedule().scheduled
    assert all(item.num_new_tokens == 1 for item in scheduled) and len(scheduled) == 3
    runner, kv_caches, batch, eager = eager_step(engine, scheduled)

    widths = {kind: 40 for kind in engine.kv_cache.pools}  # wider than needed, as captured
    graphs = DecodeGraphs(engine.model, kv_caches, widths, 8, runner.block_size,
                          engine.device)
    size = graphs.prepare(batch)
    assert size == 4  # three requests padded to the bucket of four
    with torch.inference_mode():
        padded = engine.model(*graphs._inputs(size), kv_caches)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    # The tiny preset has both kinds of layers, so both kinds of tables were padded.
    assert set(widths) == {"sliding_attention", "full_attention"}


def test_graph_inputs_kept_across_steps_give_the_eager_hidden_states():
    """The static inputs of one graph object over a whole run, on any device: block tables
    are rewritten only where a row changed (a request finished and the rows after it moved
    up, a block was added, a sliding window moved on), and every decode step's padded inputs
    still give the eager hidden states."""
    llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", device="cpu",
              enforce_eager=True, max_num_seqs=8, overlap_schedule=False)
    engine = llm.engine
    worker, runner = engine.executor.worker, engine.runner
    widths = {kind: 40 for kind in engine.kv_cache.pools}
    graphs = DecodeGraphs(engine.model, worker.kv_caches, widths, 8, runner.block_size,
                          engine.device)
    eager_forward, checked = worker._forward, []

    def checking(batch, pending, previous_tokens, *rest):
        hidden = eager_forward(batch, pending, previous_tokens, *rest)
        size = graphs.prepare(batch)
        if size is not None:
            with torch.inference_mode():
                padded = engine.model(*graphs._inputs(size), worker.kv_caches)
            torch.testing.assert_close(padded[:batch.num_requests], hidden, atol=1e-5,
                                       rtol=1e-5)
            checked.append(batch.num_requests)
        return hidden

    worker._forward = checking
    prompts = mixed_prompts(8192, 16, count=6, seed=8)
    lengths = [5, 40, 12, 33, 20, 26]  # requests end one by one, the rest move up
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n,
                                                    ignore_eos=True) for n in lengths])
    assert [len(o.outputs[0].token_ids) for o in outputs] == lengths
    assert len(checked) > 30 and len(set(checked)) >= 4


def test_padded_verify_graph_inputs_give_the_eager_hidden_states():
    """Verify graphs give every request 1 + k query rows: requests with fewer tokens (some
    drafts, none at all) are padded after their own tokens, and their real rows still get
    the hidden states of the unpadded step."""
    llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", device="cpu",
              enforce_eager=True, max_num_seqs=8)
    engine = llm.engine
    prompts = mixed_prompts(8192, 16, count=3, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    for _ in range(3):
        engine.step()
    running = list(engine.scheduler.running)
    for request, drafts in zip(running, ([5, 6, 7], [], [8])):
        request.spec_token_ids = drafts
    scheduled = engine.scheduler.schedule().scheduled
    assert [item.num_new_tokens for item in scheduled] == [4, 1, 2]
    runner, kv_caches, batch, eager = eager_step(engine, scheduled)

    widths = {kind: 40 for kind in engine.kv_cache.pools}
    graphs = DecodeGraphs(engine.model, kv_caches, widths, 8, runner.block_size,
                          engine.device, query_len=5)
    assert DecodeGraphs(engine.model, kv_caches, widths, 8, runner.block_size,
                        engine.device).prepare(batch) is None  # decode graphs: one token
    size = graphs.prepare(batch)
    assert size == 4
    assert graphs.real_rows[:7].tolist() == [0, 1, 2, 3, 5, 10, 11]
    with torch.inference_mode():
        padded = engine.model(*graphs._inputs(size), kv_caches)
    torch.testing.assert_close(padded[graphs.real_rows[:7]], eager, atol=1e-5, rtol=1e-5)


def test_padded_prefill_graph_inputs_give_the_eager_hidden_states():
    """A one-request prefill step (after a prefix-cache hit, so its positions start past 0)
    padded to a prefill graph's query length: its real rows get the eager step's hidden
    states; two requests' prefill, or one longer than the graph, is not taken."""
    llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", device="cpu",
              enforce_eager=True, max_num_seqs=8)
    engine = llm.engine
    shared = mixed_prompts(8192, 32, count=1, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([shared], params)  # caches the first 32 tokens' blocks
    engine.add_request("r", shared + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], params)
    scheduled = engine.scheduler.schedule().scheduled
    new_tokens = scheduled[0].num_new_tokens
    assert len(scheduled) == 1 and 8 < new_tokens < 42  # after the cached blocks
    runner, kv_caches, batch, eager = eager_step(engine, scheduled)
    assert batch.positions[0] > 0

    widths = {kind: 40 for kind in engine.kv_cache.pools}
    graphs = DecodeGraphs(engine.model, kv_caches, widths, 1, runner.block_size,
                          engine.device, query_len=48)
    assert DecodeGraphs(engine.model, kv_caches, widths, 1, runner.block_size,
                        engine.device, query_len=8).prepare(batch) is None  # too short
    assert graphs.prepare(batch) == 1
    assert graphs.real_rows[:new_tokens].tolist() == list(range(new_tokens))
    with torch.inference_mode():
        padded = engine.model(*graphs._inputs(1), kv_caches)
    torch.testing.assert_close(padded[:new_tokens], eager, atol=1e-5, rtol=1e-5)

    two = HostBatch(kinds=["full_attention"], max_query_len=3, input_ids=[1, 2, 3, 4, 5, 6],
                    positions=[0, 1, 2, 0, 1, 2], token_request=[0, 0, 0, 1, 1, 1],
                    query_start=[0, 3, 6], seq_lens=[3, 3],
                    slots={"full_attention": [16, 17, 18, 32, 33, 34]},
                    tables={"full_attention": [[1], [2]]},
                    first_blocks={"full_attention": [0, 0]})
    full = DecodeGraphs(engine.model, kv_caches, {"full_attention": 40}, 1, runner.block_size,
                        engine.device, query_len=16)
    assert not full.covers(two)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_prefill_graph_replays_match_eager_prefills():
    """Prompts of 5 to 300 tokens, one request at a time: every prefill replays a prefill
    graph (or, up to the verify length, a verify graph), and the outputs, logprobs and prompt
    logprobs included, equal the eager engine's."""
    prompts = [p[:n] for p, n in zip(mixed_prompts(8192, 300, count=6, seed=9),
                                     (5, 17, 40, 100, 257, 300))]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, prompt_logprobs=1,
                            ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", enforce_eager=eager,
                  max_num_seqs=4, enable_prefix_caching=False)
        outputs[eager] = [llm.generate([prompt], params)[0] for prompt in prompts]
        if not eager:
            prefill = [g for g in llm.engine.runner.executor.worker.graphs if g.query_len > 1]
            assert prefill[0].query_len == 16
            assert prefill[-1].query_len == EngineArgs.prefill_graph_max_tokens
            assert sum(g.replays for g in prefill) == len(prompts)  # every prefill step
    assert_same_outputs(outputs[False], outputs[True])


def test_greedy_replay_drafts_over_the_narrowest_table_that_holds_the_step():
    """A verify graph's greedy versions differ in how many blocks their drafting reads; a
    step replays the narrowest that holds its widest table (any: the full one)."""
    assert draft_widths(256) == [8, 32, 128, 256]
    assert draft_widths(3) == [1, 3] and draft_widths(1) == [1]
    graphs = DecodeGraphs(torch.nn.Module(), [], {"full_attention": 256}, 4, 16,
                          torch.device("cpu"), query_len=8, greedy_verification=True)
    replayed = []

    class Graph:
        def __init__(self, width: int) -> None:
            self.width = width

        def replay(self) -> None:
            replayed.append(self.width)

    outputs = StepOutputs(torch.zeros(1, 8), torch.zeros(4, 9), torch.zeros(4, 7))
    for width in draft_widths(256):
        graphs.greedy_graphs[1, width] = (Graph(width), outputs)
    for width in (1, 8, 9, 100, 256, None):
        assert graphs.replay_greedy(1, 1, width) is not None
    assert replayed == [8, 8, 32, 128, 256, 256]
    assert graphs.replay_greedy(2, 2, 8) is None  # no greedy version of that bucket
    assert graphs.greedy_replay_widths == {8: 2, 32: 1, 128: 1, 256: 2}

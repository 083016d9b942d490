"""Decode CUDA graphs: bucket choice, padded metadata, and replay equal to eager steps."""

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.cuda_graphs import DecodeGraphs, batch_buckets
from muse.engine.metadata import HostBatch
from tests.engine.helpers import assert_greedy_is_well_defined, assert_same_outputs, mixed_prompts


def test_buckets_cover_every_batch_size():
    for largest in (1, 3, 8, 100, 256):
        buckets = batch_buckets(largest)
        assert buckets == sorted(set(buckets)) and buckets[-1] == largest
        assert all(any(b >= n for b in buckets) for n in range(1, largest + 1))


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

"""Decode CUDA graphs: bucket choice, padded metadata, and replay equal to eager steps."""

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.cuda_graphs import batch_buckets
from muse.engine.metadata import HostBatch
from tests.engine.helpers import mixed_prompts


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
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for eager in (True, False):
        llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", enforce_eager=eager,
                  max_num_seqs=16)
        outputs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.decode_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs.replays >= 9  # every decode step after the prefill steps
    assert outputs[True] == outputs[False]

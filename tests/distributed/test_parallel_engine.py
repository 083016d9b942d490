"""Tensor, pipeline and expert parallelism on CPU (gloo): greedy output equals the one-process
engine's.

Each layout runs the tiny preset and a Qwen3-MoE checkpoint written by transformers, with
chunked prefill, prefix-cache hits and preemptions forced by a small KV budget in the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from muse import LLM, SamplingParams
from tests.engine.helpers import MIN_GREEDY_GAP, mixed_prompts, reference_greedy

MAX_TOKENS = 8
# (tensor, pipeline, expert parallel): 4 TP ranks replicate the 2 K/V heads.
LAYOUTS = [(2, 1, False), (4, 1, False), (2, 1, True), (4, 1, True), (1, 2, False),
           (2, 2, False)]
LAYOUT_IDS = ["tp2", "tp4", "ep2", "ep4", "pp2", "tp2xpp2"]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.test_hf_equivalence import moe_model

    directory = tmp_path_factory.mktemp("qwen3-moe")
    moe_model(norm_topk_prob=False, sliding=True).save_pretrained(directory)
    return directory


def kv_bytes_per_token(llm: LLM) -> int:
    """One token's K and V on one rank (every layer), float32."""
    config = llm.engine.config
    return config.num_hidden_layers * 2 * llm.engine.model.num_kv_heads * config.head_dim * 4


def run(model: str, prompts: list[list[int]], **engine_args) -> tuple[list, dict]:
    llm = LLM(model, device="cpu", dtype="float32", max_num_batched_tokens=40, max_num_seqs=8,
              **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        stats = {"hits": llm.engine.kv_cache.stats.hits,
                 "preemptions": llm.engine.scheduler.num_preemptions,
                 "kv_heads": llm.engine.model.num_kv_heads,
                 "token_bytes": kv_bytes_per_token(llm)}
    finally:
        llm.shutdown()
    return tokens, stats


@pytest.fixture(scope="module")
def single_process(qwen3_moe: Path) -> dict[str, tuple[list, list, int]]:
    """model -> (prompts, greedy tokens of the one-process engine, its K/V bytes per token)."""
    from muse.checkpoint import load_reference_model
    from muse.presets import get_preset
    from muse.reference.model import MuseForCausalLM

    expected = {}
    for model in ("muse-spark-tiny", str(qwen3_moe)):
        if model == "muse-spark-tiny":
            reference = MuseForCausalLM(get_preset(model).text_config)
            reference.init_weights(0, 0.1)
        else:
            reference = load_reference_model(model)
        config = reference.config
        prompts = mixed_prompts(config.vocab_size, config.sliding_window or 16, count=12)
        _, gap = reference_greedy(reference.eval(), prompts, MAX_TOKENS)
        assert gap > MIN_GREEDY_GAP  # an argmax that rounding cannot flip
        extra = {"init_std": 0.1} if model == "muse-spark-tiny" else {}
        tokens, stats = run(model, prompts, **extra)
        expected[model] = (prompts, tokens, stats["token_bytes"], extra)
    return expected


@pytest.mark.parametrize(("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel"),
                         LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("which", ["tiny", "qwen3-moe"])
def test_parallel_greedy_equals_one_process(single_process, qwen3_moe, which,
                                            tensor_parallel_size, pipeline_parallel_size,
                                            expert_parallel):
    model = "muse-spark-tiny" if which == "tiny" else str(qwen3_moe)
    prompts, want, token_bytes, extra = single_process[model]
    one_rank_kv_heads = 2
    kv_heads = max(1, one_rank_kv_heads // tensor_parallel_size)
    # The same number of KV blocks as a one-process run with room for ~200 tokens: the batch
    # cannot all fit, so requests are preempted and recomputed. A rank holds its share of the
    # K/V heads and 1/pp of the layers.
    budget = 200 * token_bytes * kv_heads // one_rank_kv_heads // pipeline_parallel_size
    got, stats = run(model, prompts, tensor_parallel_size=tensor_parallel_size,
                     pipeline_parallel_size=pipeline_parallel_size,
                     enable_expert_parallel=expert_parallel, kv_cache_memory_bytes=budget,
                     **extra)
    assert got == want
    assert stats["kv_heads"] == kv_heads
    assert stats["hits"] > 0 and stats["preemptions"] > 0

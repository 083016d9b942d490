"""Tensor, pipeline, expert, data and prefill-context parallelism on CPU (gloo): greedy output
equals the one-process engine's.

Each layout runs the tiny preset and a Qwen3-MoE checkpoint written by transformers, with
chunked prefill, prefix-cache hits and preemptions forced by a small KV budget in the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from muse import LLM, SamplingParams
from tests.engine.helpers import (MIN_GREEDY_GAP, assert_same_outputs, mixed_prompts,
                                  reference_greedy)

MAX_TOKENS = 8
# 4 TP ranks replicate the 2 K/V heads; DP ranks each schedule their own share of the prompts.
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "ep4": {"tensor_parallel_size": 4, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2xpp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp2xep": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "pcp2": {"prefill_context_parallel_size": 2},
}


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.test_hf_equivalence import moe_model

    directory = tmp_path_factory.mktemp("qwen3-moe")
    moe_model(norm_topk_prob=False, sliding=True).save_pretrained(directory)
    return directory


def kv_bytes_per_token(llm: LLM) -> int:
    """One token's K and V on one rank (every layer), float32."""
    config, model = llm.engine.config, llm.engine.replicas[0].model
    return config.num_hidden_layers * 2 * model.num_kv_heads * config.head_dim * 4


def run(model: str, prompts: list[list[int]], **engine_args) -> tuple[list, dict]:
    llm = LLM(model, device="cpu", dtype="float32", max_num_batched_tokens=40, max_num_seqs=8,
              **engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # The longest prompt twice more, alone: the second run finds its KV in the prefix
        # cache (an idle engine places both on the same data-parallel rank).
        longest = max(prompts, key=len)
        tokens += [llm.generate([longest], params)[0].outputs[0].token_ids for _ in range(2)]
        replicas = llm.engine.replicas  # one per data-parallel rank
        worker = llm.engine.executor.worker  # rank 0's
        stats = {"hits": [r.kv_cache.stats.hits for r in replicas],
                 "preemptions": [r.scheduler.num_preemptions for r in replicas],
                 "kv_heads": replicas[0].model.num_kv_heads,
                 "token_bytes": kv_bytes_per_token(llm),
                 # pipeline steps by their number of micro-batches
                 "micro_batches": dict(worker.micro_batch_steps),
                 "context_parallel_steps": worker.context_parallel_steps}
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


# Four-rank worlds are the slowest on a 2-core machine: each runs on one of the models (both
# replicate K/V heads over four ranks; the tiny preset's experts are latent, Qwen3-MoE's not).
FOUR_RANKS_ON = {"tp4": "qwen3-moe", "ep4": "tiny"}
CASES = [pytest.param(which, layout, id=f"{which}-{name}")
         for which in ("tiny", "qwen3-moe") for name, layout in LAYOUTS.items()
         if FOUR_RANKS_ON.get(name, which) == which]


@pytest.mark.parametrize(("which", "layout"), CASES)
def test_parallel_greedy_equals_one_process(single_process, qwen3_moe, which, layout):
    model = "muse-spark-tiny" if which == "tiny" else str(qwen3_moe)
    prompts, want, token_bytes, extra = single_process[model]
    tensor_parallel_size = layout.get("tensor_parallel_size", 1)
    pipeline_parallel_size = layout.get("pipeline_parallel_size", 1)
    one_rank_kv_heads = 2
    kv_heads = max(1, one_rank_kv_heads // tensor_parallel_size)
    # The same number of KV blocks as a one-process run with room for ~200 tokens: the batch
    # cannot all fit, so requests are preempted and recomputed. A rank holds its share of the
    # K/V heads and 1/pp of the layers; each data-parallel rank has a cache of its own for
    # about half the requests (3/4 of the room: the longest prompt must still fit).
    tokens = 150 if "data_parallel_size" in layout else 200
    budget = tokens * token_bytes * kv_heads // one_rank_kv_heads // pipeline_parallel_size
    got, stats = run(model, prompts, kv_cache_memory_bytes=budget, **layout, **extra)
    assert got == want
    assert stats["kv_heads"] == kv_heads
    # The prefix cache was hit, and every data-parallel rank preempted.
    assert sum(stats["hits"]) > 0 and min(stats["preemptions"]) > 0, stats
    if pipeline_parallel_size > 1:
        # Steps of several requests ran as one micro-batch per stage; never more.
        assert stats["micro_batches"].get(pipeline_parallel_size, 0) > 0, stats
        assert max(stats["micro_batches"]) == pipeline_parallel_size
    # Steps were split over the context-parallel ranks (and only then).
    assert (stats["context_parallel_steps"] > 0) == ("prefill_context_parallel_size" in layout)


def test_pp2_micro_batches_keep_logits_order(single_process):
    """Logits rows come back from the micro-batches in the step's order, also when prompt
    logprob rows come before the sampled rows: logprobs equal the one-process engine's."""
    prompts, _, _, extra = single_process["muse-spark-tiny"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    outputs, steps = {}, {}
    for pp in (1, 2):
        llm = LLM("muse-spark-tiny", device="cpu", dtype="float32", max_num_batched_tokens=40,
                  max_num_seqs=8, pipeline_parallel_size=pp, **extra)
        try:
            outputs[pp] = llm.generate(prompts[:6], params)
            steps[pp] = dict(llm.engine.executor.worker.micro_batch_steps)
        finally:
            llm.shutdown()
    assert steps[1] == {} and steps[2].get(2, 0) > 0, steps
    assert_same_outputs(outputs[2], outputs[1])

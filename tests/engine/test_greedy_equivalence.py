"""The engine's greedy output is the reference model's, token for token, under stress."""

import pytest
import torch

from muse import LLM, SamplingParams
from tests.conftest import DEVICE
from tests.engine.helpers import (MIN_GREEDY_GAP, assert_same_logprobs, mixed_prompts,
                                  reference_from_engine, reference_greedy,
                                  reference_token_logprobs)

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def expected():
    """Reference outputs for the prompt set, computed once."""
    llm = LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32")
    reference = reference_from_engine(llm.engine)
    config = llm.engine.config
    prompts = mixed_prompts(config.vocab_size, config.sliding_window)
    outputs, smallest_gap = reference_greedy(reference, prompts, MAX_TOKENS)
    # The comparison only means something if float error cannot flip an argmax.
    assert smallest_gap > MIN_GREEDY_GAP
    return prompts, outputs


def run_engine(prompts, **engine_args):
    llm = LLM("muse-spark-tiny", init_std=0.1, device=DEVICE, dtype="float32", **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_one_batch_with_chunked_prefill(expected):
    prompts, want = expected
    longest = max(len(p) for p in prompts)
    llm, got = run_engine(prompts, max_num_batched_tokens=48)
    assert 48 < longest  # prompts really are chunked
    assert got == want


def test_prefix_cache_hits(expected):
    prompts, want = expected
    llm, got = run_engine(prompts, max_num_batched_tokens=64)
    assert got == want
    first_hits = llm.engine.kv_cache.stats.hits
    assert first_hits > 0  # prompts sharing a prefix were served from the cache
    # A second round over the same prompts reuses what the first one left behind.
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert again == want
    assert llm.engine.kv_cache.stats.hits > 2 * first_hits


def test_preemption_under_a_tiny_kv_budget(expected):
    prompts, want = expected
    config_bytes_per_token = 6 * 2 * 2 * 16 * 4  # layers * (K, V) * kv heads * dim * fp32
    llm, got = run_engine(prompts, max_num_batched_tokens=64, max_num_seqs=32,
                          kv_cache_memory_bytes=700 * config_bytes_per_token)
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0


def test_without_prefix_caching(expected):
    prompts, want = expected
    llm, got = run_engine(prompts, enable_prefix_caching=False, max_num_batched_tokens=32)
    assert got == want
    assert llm.engine.kv_cache.stats.hits == 0


def test_prefill_logits_match_the_reference():
    llm = LLM("muse-spark-tiny", init_std=0.1, device=DEVICE, dtype="float32",
              max_num_batched_tokens=40)
    reference = reference_from_engine(llm.engine)
    prompt = mixed_prompts(llm.engine.config.vocab_size, 16, count=1, seed=5)[0]
    prompt = prompt + prompt[:50]
    output = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    with torch.no_grad():
        logprobs = reference(torch.tensor([prompt])).logits[0].log_softmax(-1)
    want = [None] + [reference_token_logprobs(logprobs[position], token, 3)
                     for position, token in enumerate(prompt[1:])]
    assert_same_logprobs(output.prompt_logprobs, want, "prompt logprobs")


def test_qwen3_moe_checkpoint(tmp_path):
    """A Hugging Face Qwen3-MoE checkpoint (every layer sliding) through the whole engine."""
    pytest.importorskip("transformers")
    from muse.checkpoint import load_reference_model
    from tests.test_hf_equivalence import moe_model

    window = 8
    moe_model(norm_topk_prob=False, sliding=True).save_pretrained(tmp_path)
    reference = load_reference_model(tmp_path)
    assert reference.config.sliding_window == window
    prompts = mixed_prompts(reference.config.vocab_size, window)
    want, smallest_gap = reference_greedy(reference, prompts, MAX_TOKENS)
    assert smallest_gap > MIN_GREEDY_GAP
    token_bytes = 4 * 2 * 2 * 16 * 4  # one token's K and V in all 4 layers, fp32
    for engine_args in ({"max_num_batched_tokens": 40},
                        {"max_num_batched_tokens": 40, "kv_cache_memory_bytes": 9 * 16 * token_bytes}):
        llm = LLM(str(tmp_path), device=DEVICE, dtype="float32", **engine_args)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
    assert llm.engine.kv_cache.stats.hits > 0
    assert llm.engine.scheduler.num_preemptions > 0

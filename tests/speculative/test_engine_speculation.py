"""Speculative decoding in the engine (n-gram drafts): outputs equal plain decoding's, drafts
are really verified and accepted, stops inside an accepted span cut the output, and the
counters add up."""

from __future__ import annotations

import json

import pytest

from muse import LLM, SamplingParams
from muse.engine.request import Request
from muse.engine.structured_output import StructuredOutput
from muse.presets import SHIPPED_CHECKPOINT
from tests.engine.helpers import assert_same_outputs, mixed_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def engine(**args) -> LLM:
    args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    return LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32", **args)


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose continuations repeat themselves under the tiny model (its greedy output
    falls into short cycles), so n-gram drafts are often right."""
    loops = [[5, 6, 7, 8, 9] * 3, [100, 200, 300] * 3, [11, 12, 13, 14, 15, 16], [42] * 6]
    return loops + mixed_prompts(8192, 16, count=8, seed=3)


@pytest.fixture(scope="module")
def plain_and_speculative():
    plain, speculative = engine(), engine(speculative_config=NGRAM)
    yield plain, speculative
    plain.shutdown()
    speculative.shutdown()


def test_greedy_output_and_logprobs_equal_plain_decoding(plain_and_speculative):
    plain, speculative = plain_and_speculative
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompts = repetitive_prompts()
    want = plain.generate(prompts, params)
    before = speculative.engine.spec_stats.num_accepted_tokens
    assert_same_outputs(speculative.generate(prompts, params), want)
    stats = speculative.engine.spec_stats
    assert stats.num_accepted_tokens > before  # drafts were accepted, not only proposed
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some were rejected
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert stats.mean_acceptance_length > 1.0


def test_chunked_prefill_prefix_hits_and_preemption_keep_outputs(plain_and_speculative):
    plain, _ = plain_and_speculative
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = repetitive_prompts()
    longest = max(prompts, key=len)
    want = plain.generate(prompts, params) + plain.generate([longest], params)
    # A small cache and token budget: chunks and preemptions; the longest prompt once more,
    # alone, finds its prefix cached.
    small = engine(speculative_config=NGRAM, max_num_batched_tokens=24, max_num_seqs=6,
                   kv_cache_memory_bytes=180 * 2 * 2 * 2 * 64 * 4)
    try:
        got = small.generate(prompts, params)
        got += small.generate([longest], params)
        assert_same_outputs(got, want)
        assert small.engine.scheduler.num_preemptions > 0
        assert small.engine.kv_cache.stats.hits > 0
        assert small.engine.spec_stats.num_accepted_tokens > 0
    finally:
        small.shutdown()


@pytest.mark.parametrize("field", ["max_tokens", "stop_token_ids", "eos"])
def test_stops_inside_an_accepted_span(plain_and_speculative, monkeypatch, field):
    """The token that ends a request (a stop token allowed once min_tokens are out, EOS)
    sits inside a span of accepted drafts: the output ends there exactly as in plain
    decoding, and the accepted tokens after it are dropped. An oracle proposer drafts plain
    decoding's own tokens (and what would follow the stop), so every draft is accepted.
    Drafts never run past max_tokens: that request ends on a step's last token."""
    plain, speculative = plain_and_speculative
    prompt = [100, 200, 300] * 3
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    free = plain.generate([prompt], greedy)[0].outputs[0].token_ids
    eos = speculative.engine.eos_token_ids
    if field == "max_tokens":
        params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    elif field == "stop_token_ids":
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                stop_token_ids=[free[6]], min_tokens=6)
    else:
        # EOS is a token like any other: make the model's 7th token one.
        speculative.engine.eos_token_ids = plain.engine.eos_token_ids = (free[6],)
        params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=6)
    try:
        want = plain.generate([prompt], params)
        kept = want[0].outputs[0].token_ids
        oracle_tokens = kept + plain.generate([prompt + kept], greedy)[0].outputs[0].token_ids

        def oracle(tail, num_drafts, min_n, max_n):
            done = len(tail) - len(prompt)
            return oracle_tokens[done:done + num_drafts]

        monkeypatch.setattr("muse.speculative.proposer.propose_ngram", oracle)
        stats = speculative.engine.spec_stats
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        got = speculative.generate([prompt], params)
    finally:
        speculative.engine.eos_token_ids = plain.engine.eos_token_ids = eos
    assert_same_outputs(got, want)
    drafts, draft_tokens, accepted = (stats.num_drafts - before[0],
                                      stats.num_draft_tokens - before[1],
                                      stats.num_accepted_tokens - before[2])
    assert accepted == draft_tokens > 0  # the oracle's drafts all pass
    # Tokens the steps emitted before stops cut them: the prefill's, then drafts + 1 per
    # step (a last step without drafts adds one).
    emitted = 1 + draft_tokens + drafts
    if field == "max_tokens":
        assert len(kept) in (emitted, emitted + 1)
    else:
        assert len(kept) < emitted  # accepted tokens after the stop were dropped


def test_seeded_sampling_reproduces_and_n_samples(plain_and_speculative):
    _, speculative = plain_and_speculative
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, seed=7, n=2,
                            ignore_eos=True)
    prompts = repetitive_prompts()[:4]
    first = speculative.generate(prompts, params)
    assert_same_outputs(speculative.generate(prompts, params), first)
    assert all(len(o.outputs) == 2 for o in first)


def test_penalties_see_the_drafts_as_output(plain_and_speculative):
    """Each verified position's distribution is the one plain decoding would use after the
    drafts before it: with a repetition penalty, greedy output still equals plain."""
    plain, speculative = plain_and_speculative
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                            repetition_penalty=1.3, frequency_penalty=0.2)
    prompts = repetitive_prompts()[:4]
    assert_same_outputs(speculative.generate(prompts, params), plain.generate(prompts, params))


def test_drafts_are_token_ids_past_the_known_ones():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    request.output_token_ids = [4]
    request.spec_token_ids = [7, 8]
    assert request.token_ids(2, 6) == [3, 4, 7, 8]
    assert request.token_ids(4, 6) == [7, 8]


def test_bad_speculative_configs_are_refused():
    for config, field in (({"method": "nope"}, "method"),
                          ({"method": "ngram", "num_speculative_tokens": 0},
                           "num_speculative_tokens"),
                          ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2},
                           "prompt_lookup_max"),
                          ({"method": "ngram", "extra": 1}, "unknown keys"),
                          ("{not json", "not valid JSON")):
        with pytest.raises(ValueError, match=field):
            engine(speculative_config=config)
    with pytest.raises(ValueError, match="one rank"):
        engine(speculative_config=NGRAM, tensor_parallel_size=2)


def test_a_stop_string_inside_an_accepted_span_ends_the_output_there(plain_and_speculative,
                                                                       monkeypatch):
    """Text stop strings are met by the front end after a step: the tokens a speculative
    step produced after the one completing the stop string are dropped, as if decoding had
    gone one token at a time."""
    plain, speculative = plain_and_speculative
    tokenizer = plain.tokenizer
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # With oracle drafts, steps emit tokens 0, 1-5, 6-10, ... (4 drafts and one more). A
    # prompt whose greedy output has a token with new text inside such a span (not at its
    # end): a stop string made of that text is met there.
    for prompt in mixed_prompts(8192, 16, count=8, seed=11):
        free = plain.generate([prompt], greedy)[0].outputs[0]
        index = next((i for i in (6, 7, 8, 9, 11, 12, 13, 14)
                      if tokenizer.decode(free.token_ids[i:i + 1]).strip()
                      and tokenizer.decode(free.token_ids[i:i + 1])
                      not in tokenizer.decode(free.token_ids[:i])), None)
        if index is not None:
            break
    stop = tokenizer.decode(free.token_ids[index:index + 1])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop],
                            logprobs=1)
    want = plain.generate([prompt], params)
    monkeypatch.setattr("muse.speculative.proposer.propose_ngram",
                        lambda tail, n, lo, hi: free.token_ids[len(tail) - len(prompt):][:n])
    got = speculative.generate([prompt], params)
    assert_same_outputs(got, want)
    assert len(got[0].outputs[0].token_ids) == index + 1
    assert got[0].outputs[0].finish_reason == "stop"


def test_adaptive_verification_keeps_outputs_and_follows_the_step_cost(plain_and_speculative):
    from muse.speculative.adaptive import StepCosts

    plain, _ = plain_and_speculative
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = repetitive_prompts()[:4]
    want = plain.generate(prompts, params)
    adaptive = engine(speculative_config=NGRAM | {"enable_adaptive_verification": True})
    try:
        costs = adaptive.engine.step_costs  # profiled at start-up
        assert costs is not None and costs.query_lens[0] == 1
        assert_same_outputs(adaptive.generate(prompts, params), want)
        stats = adaptive.engine.spec_stats
        # A verify step that costs what a decode step costs verifies every draft; one that
        # costs far more verifies none. Outputs stay plain decoding's either way.
        for verify, verified in ((1.0, True), (1e3, False)):
            adaptive.engine.step_costs = StepCosts(
                [1, 64], {q: [1.0 if q == 1 else verify] * 2 for q in costs.query_lens})
            before = stats.num_draft_tokens
            assert_same_outputs(adaptive.generate(prompts, params), want)
            assert (stats.num_draft_tokens > before) == verified
    finally:
        adaptive.shutdown()


def test_suffix_decoding_drafts_from_earlier_requests(plain_and_speculative):
    """An agentic loop: the same request again. Suffix decoding drafts its answer from the
    first run's output (kept once the request finished), so the second run accepts many
    drafts; outputs equal plain decoding's."""
    plain, _ = plain_and_speculative
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = mixed_prompts(8192, 16, count=1, seed=21)[0]
    want = plain.generate([prompt], params)
    suffix = engine(speculative_config={"method": "suffix", "num_speculative_tokens": 6})
    try:
        assert_same_outputs(suffix.generate([prompt], params), want)
        stats = suffix.engine.spec_stats
        before = stats.num_accepted_tokens
        assert_same_outputs(suffix.generate([prompt], params), want)
        assert stats.num_accepted_tokens - before >= 12
    finally:
        suffix.shutdown()


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
@pytest.mark.parametrize("method", ["ngram", "dspark"])
def test_a_constrained_request_beside_drafting_ones_keeps_its_grammar(method):
    """A request with a JSON schema never drafts, but shares steps with requests that do:
    its token is still sampled under its grammar (the output equals the one without
    speculation), while the others' drafts are verified."""
    schema = StructuredOutput("json_schema", schema=json.dumps(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    outputs = {}
    for config in (None, {"method": method, "num_speculative_tokens": 4}):
        llm = LLM(str(SHIPPED_CHECKPOINT), device="cpu", speculative_config=config)
        tokenizer = llm.tokenizer
        prompts = [{"prompt_token_ids": tokenizer.encode("Give me a JSON object.")},
                   {"prompt_token_ids": tokenizer.encode("one two three four " * 4)}]
        params = [SamplingParams(temperature=0.0, max_tokens=20, structured_output=schema),
                  SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
        outputs[config is None] = [o.outputs[0].token_ids for o in
                                   llm.generate(prompts, params, use_tqdm=False)]
        if config is not None:
            assert llm.engine.spec_stats.num_drafts > 0
        llm.shutdown()
    assert outputs[False] == outputs[True]
    assert tokenizer.decode(outputs[False][0]).startswith('{"a": ')

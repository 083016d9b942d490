"""The overlapped schedule (step n+1 launched before step n is read back) changes nothing a
request sees: the same tokens, logprobs and finish reasons as running steps one at a time."""


import pytest

from muse import LLM, SamplingParams
from tests.engine.helpers import (assert_greedy_is_well_defined, assert_same_outputs,
                                  random_prompt, tiny_llm)


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {overlap: tiny_llm(overlap_schedule=overlap, max_num_batched_tokens=40)
            for overlap in (True, False)}


def test_overlapped_and_one_at_a_time_schedules_agree(engines):
    prompts = [random_prompt(length, seed) for seed, length in
               enumerate([5, 17, 33, 64, 90, 12, 48, 3, 71])]
    # A stop token the greedy run of prompt 1 meets at its 5th token ends it mid-batch.
    probe = engines[False].generate([prompts[1]], SamplingParams(temperature=0.0,
                                                                 max_tokens=8))
    stop_token = probe[0].outputs[0].token_ids[4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop_token]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=6, n=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=11, logprobs=2, ignore_eos=True),
        # Its steps are read back before the next launch: a penalty needs the tokens.
        SamplingParams(temperature=0.0, max_tokens=7, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=5, min_tokens=5, ignore_eos=False),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
    ]
    overlapped = engines[True].generate(prompts, params)
    one_at_a_time = engines[False].generate(prompts, params)
    assert_same_outputs(overlapped, one_at_a_time)
    stopped = overlapped[1].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == 5
    # Plain greedy requests must not hinge on a near tie. A seeded draw flips only when it
    # lands within float noise of a boundary between two tokens' probabilities, which no
    # test can rule out but which is vanishingly rare.
    greedy = [i for i, p in enumerate(params)
              if p.temperature == 0.0 and p.repetition_penalty == 1.0]
    assert_greedy_is_well_defined(
        engines[False], [prompts[i] for i in greedy for _ in one_at_a_time[i].outputs],
        [sample.token_ids for i in greedy for sample in one_at_a_time[i].outputs])
    for engine in engines.values():
        assert not engine.engine.has_unfinished()
        assert sum(p.num_used for p in engine.engine.kv_cache.pools.values()) == 0


def test_a_decode_step_is_read_back_after_the_next_launch(engines):
    engine = engines[True].engine
    request, = engine.add_request("plain", random_prompt(20, 1),
                                  SamplingParams(temperature=0.0, max_tokens=4,
                                                 ignore_eos=True))
    assert engine.step() == []  # the prefill runs; its token is not read back yet
    assert engine.in_flight is not None
    assert (request.num_output_tokens, request.output_token_ids) == (1, [])
    assert engine.step() == [request]  # launches the second token, reads the first
    assert (request.num_output_tokens, len(request.output_token_ids)) == (2, 1)
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) == 4 and request.finish_reason == "length"


def test_a_request_that_needs_its_tokens_is_read_back_at_once(engines):
    engine = engines[True].engine
    request, = engine.add_request("penalized", random_prompt(20, 2),
                                  SamplingParams(temperature=0.0, max_tokens=3,
                                                 presence_penalty=0.5, ignore_eos=True))
    assert engine.step() == [request]
    assert engine.in_flight is None and len(request.output_token_ids) == 1
    while engine.has_unfinished():
        engine.step()
    assert len(request.output_token_ids) == 3


def test_no_step_is_launched_past_the_length_limit(engines):
    engine = engines[True].engine
    request, = engine.add_request("short", random_prompt(20, 3),
                                  SamplingParams(temperature=0.0, max_tokens=2,
                                                 ignore_eos=True))
    engine.step()
    engine.step()  # launches the second and last token
    assert request.final_token_pending
    computed = request.num_computed_tokens
    assert engine.step() == [request]  # nothing launched: only the read back
    assert request.num_computed_tokens == computed
    assert request.finish_reason == "length" and len(request.output_token_ids) == 2


def test_a_request_in_both_steps_read_back_is_reported_once(engines):
    """A step read back at once (a penalized request joins) right after the one in flight:
    the requests of both come back once each, with both their tokens."""
    engine = engines[True].engine
    plain, = engine.add_request("plain-2", random_prompt(20, 4), SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.step()  # plain's prefill, in flight
    penalized, = engine.add_request("penalized-2", random_prompt(8, 5), SamplingParams(
        temperature=0.0, max_tokens=6, frequency_penalty=0.5, ignore_eos=True))
    changed = engine.step()  # plain decodes with penalized's prefill: read back at once
    assert engine.in_flight is None
    assert sorted(r.request_id for r in changed) == ["penalized-2", "plain-2"]
    assert len(plain.output_token_ids) == 2 and len(penalized.output_token_ids) == 1
    while engine.has_unfinished():
        engine.step()


def test_a_step_whose_requests_all_ended_is_not_read_back(engines):
    """A request aborted while its next step runs: that step is dropped without waiting for
    the device (nothing of it is read), and the request's blocks are free."""
    engine = engines[True].engine
    request, = engine.add_request("aborted", random_prompt(20, 6), SamplingParams(
        temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()  # the second token in flight
    step = engine.in_flight
    assert step is not None and step.scheduled[0].request is request

    def not_read() -> list:
        raise AssertionError("a step of ended requests was read back")

    step.token_values = not_read
    engine.abort("aborted")
    assert engine.step() == [] and engine.in_flight is None
    assert not engine.has_unfinished()
    assert sum(p.num_used for p in engine.kv_cache.pools.values()) == 0

"""Requests through `muse.LLM` and the engine core: admission, n > 1, stopping, logprobs, aborts."""


import pytest
import torch

from muse import LLM, SamplingParams
from muse.config import FULL, SLIDING
from muse.engine.kv_budget import block_bytes
from muse.engine.request import RequestStatus
from muse.engine.sampling_params import InvalidRequestError
from muse.presets import get_preset
from tests.engine.helpers import (LOGPROB_ATOL, LOGPROB_RTOL, assert_greedy_is_well_defined,
                                  assert_same_logprobs, assert_same_outputs, random_prompt,
                                  reference_from_engine, reference_token_logprobs, tiny_llm)

EOS = 2


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_llm()


def greedy(max_tokens: int | None, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


def blocks_in_use(llm: LLM) -> int:
    return sum(pool.num_used for pool in llm.engine.kv_cache.pools.values())


# ---- admission -------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, params, param, fragment", [
    ([], {}, "prompt", "empty"),
    ([5, 8192], {}, "prompt", "[0, 8192)"),
    ([5, -1], {}, "prompt", "-1"),
    ([5], dict(temperature=-0.5), "temperature", "`temperature`"),
    ([5], dict(top_p=0.0), "top_p", "`top_p`"),
    ([5], dict(top_p=1.5), "top_p", "`top_p`"),
    ([5], dict(n=0), "n", "`n`"),
    ([5], dict(max_tokens=0), "max_tokens", "`max_tokens`"),
    ([5], dict(min_tokens=5, max_tokens=3), "min_tokens", "`min_tokens`"),
    ([5], dict(logprobs=21), "logprobs", "`logprobs`"),
    ([5], dict(prompt_logprobs=21), "prompt_logprobs", "`prompt_logprobs`"),
    ([5], dict(logit_bias={"5": 1.0}), "logit_bias", "'5'"),
    ([5], dict(logit_bias={8192: 1.0}), "logit_bias", "8192"),
    ([5], dict(logit_bias={5: 101.0}), "logit_bias", "[-100, 100]"),
    ([5], dict(stop_token_ids=[9000]), "stop_token_ids", "`stop_token_ids`"),
    ([5], dict(stop=[""]), "stop", "`stop`"),
])
def test_admission_rejects_bad_requests(llm, prompt, params, param, fragment):
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request("bad", prompt, SamplingParams(**params))
    assert error.value.param == param
    assert fragment in str(error.value)
    with pytest.raises(InvalidRequestError):
        llm.generate([prompt], SamplingParams(**params))
    assert not llm.engine.has_unfinished()
    assert blocks_in_use(llm) == 0


def test_admission_rejects_a_prompt_that_fills_the_context(llm):
    limit = llm.engine.max_model_len
    with pytest.raises(InvalidRequestError) as error:
        llm.engine.add_request("long", [5] * limit, SamplingParams())
    assert error.value.param == "prompt"
    assert str(limit) in str(error.value) and "context length" in str(error.value)
    small = tiny_llm(max_model_len=24)
    with pytest.raises(InvalidRequestError, match="24 tokens"):
        small.generate([[5] * 24])
    # One token less fits; the output is cut at the context length.
    output = small.generate([[5] * 23], greedy(10, ignore_eos=True))[0].outputs[0]
    assert (len(output.token_ids), output.finish_reason) == (1, "length")
    output = small.generate([[5] * 20], greedy(None, ignore_eos=True))[0].outputs[0]
    assert (len(output.token_ids), output.finish_reason) == (4, "length")


def test_a_rejected_request_leaves_the_others_running(llm):
    engine = llm.engine
    good = [engine.add_request(f"good-{i}", random_prompt(12 + i, 100 + i),
                               greedy(4 + i, ignore_eos=True))[0] for i in range(3)]
    engine.step()
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad", [5, 6], SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good-1", [5, 6], SamplingParams())
    assert "bad" not in engine.requests
    while engine.has_unfinished():
        engine.step()
    assert [len(r.output_token_ids) for r in good] == [4, 5, 6]
    assert [r.finish_reason for r in good] == ["length"] * 3
    # The same prompts alone give the same tokens.
    alone = llm.generate([r.prompt_token_ids for r in good],
                         [greedy(4 + i, ignore_eos=True) for i in range(3)])
    assert [o.outputs[0].token_ids for o in alone] == [r.output_token_ids for r in good]
    assert [o.outputs[0].finish_reason for o in alone] == ["length"] * 3
    assert_greedy_is_well_defined(llm, [r.prompt_token_ids for r in good],
                                  [r.output_token_ids for r in good])
    assert blocks_in_use(llm) == 0


# ---- n > 1 -----------------------------------------------------------------------------------
def test_n_samples_are_indexed_and_reproducible(llm):
    prompt = random_prompt(20, 110)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    first = llm.generate([prompt], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in first.outputs)
    samples = [tuple(c.token_ids) for c in first.outputs]
    assert len(set(samples)) == 4  # each sample draws from its own stream
    again = llm.generate([prompt], params)[0]
    assert_same_outputs(again.outputs, first.outputs)
    # In a fresh engine, in a batch with other requests: still the same tokens.
    other = tiny_llm().generate([random_prompt(30, 111), prompt],
                                [SamplingParams(temperature=1.0, max_tokens=8), params])[1]
    assert_same_outputs(other.outputs, first.outputs)
    reseeded = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=12,
                                                     max_tokens=6, ignore_eos=True))[0]
    assert [tuple(c.token_ids) for c in reseeded.outputs] != samples


def test_n_samples_share_the_prompt_blocks(llm):
    engine, kv_cache = llm.engine, llm.engine.kv_cache
    prompt = random_prompt(50, 120)  # 3 full blocks of 16 can be shared: (50 - 1) // 16
    samples = engine.add_request("group", prompt, greedy(5, n=4, ignore_eos=True))
    parent, children = samples[0], samples[1:]
    engine.step()  # the first sample's prefill; the others fork from it
    parent_full = kv_cache.block_tables(parent)[FULL]
    shared_full = parent_full[:3]
    for child in children:
        assert child.num_computed_tokens == 48
        assert kv_cache.block_tables(child)[FULL] == shared_full
    assert [kv_cache.pools[FULL].ref_counts[b] for b in shared_full] == [4, 4, 4]
    # Sliding layers share only the window the children's next query needs (block 2).
    shared_sliding = kv_cache.block_tables(children[0])[SLIDING]
    assert shared_sliding[:2] == [0, 0] and shared_sliding[2] != 0
    assert kv_cache.pools[SLIDING].ref_counts[shared_sliding[2]] == 4
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, kv_cache.pools[FULL].num_used)
    # Shared: 3 prompt blocks plus one private block each, far below 4 x 4 copies.
    assert peak == 3 + 4
    assert blocks_in_use(llm) == 0
    # Greedy samples agree with each other and with a single greedy request.
    outputs = [s.output_token_ids for s in samples]
    single = llm.generate([prompt], greedy(5, ignore_eos=True))[0].outputs[0].token_ids
    assert outputs == [single] * 4
    assert_greedy_is_well_defined(llm, [prompt], [single])


@pytest.mark.parametrize("length, chunk", [(50, 16), (64, 21), (40, 8192)])
def test_greedy_samples_match_a_single_request_under_chunked_prefill(length, chunk):
    # The later samples fork from the first when its prefill ends; with chunks, its sliding
    # layers may already have dropped blocks the fork would need.
    llm = tiny_llm(max_num_batched_tokens=chunk)
    prompt = random_prompt(length, 200 + length)
    single = llm.generate([prompt], greedy(6, ignore_eos=True))[0].outputs[0].token_ids
    fresh = tiny_llm(max_num_batched_tokens=chunk)
    output = fresh.generate([prompt], greedy(6, n=3, ignore_eos=True))[0]
    assert [c.token_ids for c in output.outputs] == [single] * 3
    assert [c.finish_reason for c in output.outputs] == ["length"] * 3
    assert_greedy_is_well_defined(llm, [prompt], [single])
    assert blocks_in_use(fresh) == 0


# ---- stopping --------------------------------------------------------------------------------
def test_eos_stops_unless_ignored(llm):
    prompt = random_prompt(10, 130)
    forced = {EOS: 100.0}  # makes eos the greedy choice at every step
    output = llm.generate([prompt], greedy(8, logit_bias=forced))[0].outputs[0]
    assert (output.token_ids, output.finish_reason, output.stop_reason) == ([EOS], "stop", EOS)
    output = llm.generate([prompt], greedy(8, logit_bias=forced, ignore_eos=True))[0].outputs[0]
    assert (output.token_ids, output.finish_reason) == ([EOS] * 8, "length")
    output = llm.generate([prompt], greedy(8, logit_bias=forced, min_tokens=3))[0].outputs[0]
    assert len(output.token_ids) == 4 and output.token_ids[-1] == EOS
    assert EOS not in output.token_ids[:3]
    assert output.finish_reason == "stop"


def test_stop_token_ids_and_max_tokens(llm):
    prompt = random_prompt(10, 140)
    plain = llm.generate([prompt], greedy(8, ignore_eos=True))[0].outputs[0]
    assert len(plain.token_ids) == 8 and plain.finish_reason == "length"
    assert plain.stop_reason is None
    # Stop at a greedy token (not the first) that did not occur before it.
    index = next(i for i in range(2, 8) if plain.token_ids[i] not in plain.token_ids[:i])
    stop_token = plain.token_ids[index]
    output = llm.generate([prompt], greedy(8, stop_token_ids=[stop_token],
                                           ignore_eos=True))[0].outputs[0]
    assert output.token_ids == plain.token_ids[:index + 1]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop_token)
    # min_tokens masks the stop token id until index + 2 tokens exist.
    output = llm.generate([prompt], greedy(8, stop_token_ids=[stop_token], min_tokens=index + 2,
                                           ignore_eos=True))[0].outputs[0]
    assert stop_token not in output.token_ids[:index + 2]
    assert output.token_ids[:index] == plain.token_ids[:index]
    assert len(output.token_ids) >= index + 2


def stop_string_case(llm):
    """A greedy completion and a stop string that first appears with its sixth token."""
    prompt = "The quick brown fox"
    plain = llm.generate([prompt], greedy(12, ignore_eos=True))[0].outputs[0]
    def decode(ids):
        return llm.tokenizer.decode(ids, skip_special_tokens=True)

    for index in range(3, 10):
        piece = decode([plain.token_ids[index]]).strip()
        before = decode(plain.token_ids[:index])
        if len(piece) >= 3 and piece not in before and plain.text.find(piece) >= len(before):
            return prompt, plain, piece, index
    pytest.fail(f"no usable stop string in {plain.text!r}")


def test_stop_strings_truncate_and_finish(llm):
    prompt, plain, stop, index = stop_string_case(llm)
    at = plain.text.find(stop)
    output = llm.generate([prompt], greedy(12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert output.text == plain.text[:at]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)
    assert output.token_ids == plain.token_ids[:index + 1]
    kept = llm.generate([prompt], greedy(12, stop=["zzzz-not-there", stop],
                                         include_stop_str_in_output=True,
                                         ignore_eos=True))[0].outputs[0]
    assert kept.text == plain.text[:at + len(stop)]
    assert kept.finish_reason == "stop"
    assert not llm.engine.has_unfinished() and blocks_in_use(llm) == 0


def test_stop_string_in_the_last_allowed_token_reports_stop(llm):
    # As in vLLM, a stop string found in the final text wins over the length limit.
    prompt, plain, stop, index = stop_string_case(llm)
    output = llm.generate([prompt], greedy(index + 1, stop=[stop],
                                           ignore_eos=True))[0].outputs[0]
    assert output.text == plain.text[:plain.text.find(stop)]
    assert (output.finish_reason, output.stop_reason) == ("stop", stop)


def test_stop_strings_wait_for_min_tokens(llm):
    # vLLM checks stop strings only once min_tokens tokens exist, like stop token ids.
    prompt, plain, stop, index = stop_string_case(llm)
    output = llm.generate([prompt], greedy(12, stop=[stop], min_tokens=index + 3,
                                           ignore_eos=True))[0].outputs[0]
    # The occurrence inside the first min_tokens tokens neither stops nor truncates.
    assert output.token_ids[:index + 3] == plain.token_ids[:index + 3]
    assert stop in output.text


# ---- logprobs --------------------------------------------------------------------------------
def test_logprobs_per_token_match_the_reference(llm):
    prompt = random_prompt(12, 150)
    output = llm.generate([prompt], SamplingParams(temperature=0.8, seed=3, max_tokens=6,
                                                   logprobs=4, ignore_eos=True))[0].outputs[0]
    assert len(output.logprobs) == len(output.token_ids) == 6
    reference = reference_from_engine(llm.engine)
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + output.token_ids[:-1]])).logits[0]
    raw = logits.double().log_softmax(dim=-1)[len(prompt) - 1:]
    want = [reference_token_logprobs(raw[position], token, 4)
            for position, token in enumerate(output.token_ids)]
    assert_same_logprobs(output.logprobs, want, "logprobs")
    total = 0.0
    for position, (token, entry) in enumerate(zip(output.token_ids, output.logprobs)):
        values = raw[position]
        # The rank counts the tokens above the chosen one; those within float noise of it may
        # fall on either side.
        noise = LOGPROB_ATOL + LOGPROB_RTOL * abs(float(values[token]))
        assert 1 + int((values > values[token] + noise).sum()) <= entry.rank
        assert entry.rank <= 1 + int((values > values[token] - noise).sum())
        tops = [v for _, v in entry.top]
        assert tops == sorted(tops, reverse=True)
        total += entry.logprob
    assert output.cumulative_logprob == pytest.approx(total, abs=1e-5)
    assert any(entry.rank > 1 for entry in output.logprobs)  # sampled, not always the argmax


def test_prompt_logprobs_cover_the_prompt(llm):
    prompt = random_prompt(37, 160)
    # A cached prefix would skip the positions whose logprobs are asked for.
    assert llm.generate([prompt], greedy(1))[0].num_cached_tokens == 0
    output = llm.generate([prompt], greedy(2, prompt_logprobs=2, ignore_eos=True))[0]
    assert output.num_cached_tokens == 0
    assert len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None
    assert [entry.token_id for entry in output.prompt_logprobs[1:]] == prompt[1:]
    assert all(len(entry.top) == 2 for entry in output.prompt_logprobs[1:])
    assert output.outputs[0].logprobs is None
    plain = llm.generate([prompt], greedy(2))[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens == 32


def test_prompt_logprobs_survive_preemption():
    # A KV cache of 6 blocks a kind: three 20-token prompts growing to 36 tokens cannot all fit,
    # so the newest is preempted and its prompt recomputed.
    bytes_per_block = sum(block_bytes(get_preset("muse-spark-tiny").text_config, 16,
                                      torch.float32).values())
    llm = tiny_llm(max_num_seqs=4, max_num_batched_tokens=16,
                   kv_cache_memory_bytes=6 * bytes_per_block)
    prompts = [random_prompt(20, seed) for seed in range(170, 173)]
    outputs = llm.generate(prompts, greedy(16, prompt_logprobs=1, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert len(output.outputs[0].token_ids) == 16
        assert len(output.prompt_logprobs) == len(prompt)
        assert [entry.token_id for entry in output.prompt_logprobs[1:]] == prompt[1:]


# ---- chat and streaming ----------------------------------------------------------------------
def test_chat_renders_the_template_and_generates(llm):
    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a colour."}]
    output, = llm.chat(conversation, greedy(5, ignore_eos=True))
    want_ids = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=True)
    assert output.prompt_token_ids == want_ids
    rendered = llm.tokenizer.decode(want_ids)
    assert "Name a colour." in rendered and "You are terse." in rendered
    assert len(output.outputs[0].token_ids) == 5
    direct = llm.generate([{"prompt_token_ids": want_ids}], greedy(5, ignore_eos=True))[0]
    assert output.outputs[0].token_ids == direct.outputs[0].token_ids
    both = llm.chat([conversation, conversation[1:]], greedy(3, ignore_eos=True))
    assert len(both) == 2
    assert both[0].outputs[0].token_ids == output.outputs[0].token_ids[:3]
    assert_greedy_is_well_defined(llm, [want_ids], [output.outputs[0].token_ids])
    assert len(both[1].prompt_token_ids) < len(want_ids)


def test_stream_yields_growing_outputs_then_a_final_one(llm):
    prompts = [random_prompt(9, 180), random_prompt(25, 181)]
    params = [greedy(4, ignore_eos=True), greedy(7, ignore_eos=True)]
    seen: dict[str, list] = {}
    for output in llm.stream(prompts, params):
        seen.setdefault(output.request_id, []).append(
            (list(output.outputs[0].token_ids), output.finished))
    final = llm.generate(prompts, params)
    assert len(seen) == 2
    histories = [seen[request_id] for request_id in sorted(seen, key=int)]
    for history, want, length in zip(histories, final, (4, 7)):
        assert [len(tokens) for tokens, _ in history] == list(range(1, length + 1))
        assert [finished for _, finished in history] == [False] * (length - 1) + [True]
        for tokens, _ in history:
            assert tokens == want.outputs[0].token_ids[:len(tokens)]
        assert history[-1][0] == want.outputs[0].token_ids
    assert_greedy_is_well_defined(llm, prompts, [o.outputs[0].token_ids for o in final])


def test_closing_a_stream_early_aborts_its_requests(llm):
    prompts = [random_prompt(30, 185), random_prompt(12, 186)]
    stream = llm.stream(prompts, greedy(40, n=2, ignore_eos=True))
    first = next(stream)
    assert not first.finished and blocks_in_use(llm) > 0
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.scheduler.num_unfinished == 0
    assert blocks_in_use(llm) == 0


def test_abort_mid_generation_frees_blocks_at_once(llm):
    engine, kv_cache = llm.engine, llm.engine.kv_cache
    doomed, = engine.add_request("doomed", random_prompt(40, 190), greedy(30, ignore_eos=True))
    group = engine.add_request("group", random_prompt(20, 191), greedy(30, n=2, ignore_eos=True))
    keeper, = engine.add_request("keeper", random_prompt(18, 192), greedy(6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert doomed.num_output_tokens == 3  # the latest may not be read back yet
    read_back = len(doomed.output_token_ids)
    held = {r.request_id: sum(kv_cache.num_held_blocks(r, k) for k in kv_cache.pools)
            for r in (doomed, *group, keeper)}
    assert all(held.values())
    used = blocks_in_use(llm)
    engine.abort("doomed")
    assert (doomed.status, doomed.finish_reason) == (RequestStatus.ABORTED, "abort")
    assert blocks_in_use(llm) == used - held["doomed"]
    engine.abort("group")
    assert all(r.status == RequestStatus.ABORTED for r in group)
    assert blocks_in_use(llm) == sum(kv_cache.num_held_blocks(keeper, k) for k in kv_cache.pools)
    while engine.has_unfinished():
        engine.step()
    assert len(doomed.output_token_ids) == read_back  # nothing more after the abort
    assert (len(keeper.output_token_ids), keeper.finish_reason) == (6, "length")
    assert blocks_in_use(llm) == 0

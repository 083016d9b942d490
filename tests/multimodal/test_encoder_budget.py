"""The scheduler's encoder budget (`max_num_encoder_input_tokens`) and the encoder-cache pins
of running requests: outputs do not change, no step encodes more than the budget (but for one
item larger than it, alone), and a request's half-computed item survives other items."""

from __future__ import annotations

import pytest
import torch

from muse.chat_format import IMAGE_ID
from muse.engine.args import EngineArgs
from tests.engine.helpers import random_prompt, tiny_llm
from tests.multimodal.test_engine_media import (AUDIO, IMAGE, clip, greedy, image,
                                                media_prompt)

IMAGE_TOKENS = 16  # a 112 x 112 image


def requests() -> list[dict]:
    """Three requests with an image and an audio clip each, and a text-only one."""
    out = [{"prompt_token_ids": media_prompt(seed),
            "multi_modal_data": {"image": [image(seed)], "audio": [clip(seed + 5)]}}
           for seed in (1, 2, 3)]
    return out + [{"prompt_token_ids": random_prompt(30, 9)}]


def record_encodes(llm) -> list[list]:
    """Each encoder call's items (the misses of one step), recorded as the engine runs."""
    calls: list[list] = []
    encoders = llm.engine.encoders
    encode = encoders.encode

    def counted(items):
        calls.append(list(items))
        return encode(items)

    encoders.encode = counted
    return calls


def token_ids(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return token_ids(tiny_llm(enable_prefix_caching=False).generate(
        requests(), greedy(), use_tqdm=False))


@pytest.mark.parametrize("budget", [IMAGE_TOKENS, 20])
def test_steps_encode_within_the_budget(expected, budget):
    llm = tiny_llm(max_num_encoder_input_tokens=budget, enable_prefix_caching=False)
    calls = record_encodes(llm)
    assert token_ids(llm.generate(requests(), greedy(), use_tqdm=False)) == expected
    assert sum(len(items) for items in calls) == 6  # each item once
    for items in calls:
        assert sum(item.num_tokens for item in items) <= budget
    # The budget spread the items over several steps (without it: all six in the first).
    assert len(calls) > 1


def test_an_item_larger_than_the_budget_runs_alone(expected):
    llm = tiny_llm(max_num_encoder_input_tokens=4, enable_prefix_caching=False)
    calls = record_encodes(llm)
    assert token_ids(llm.generate(requests(), greedy(), use_tqdm=False)) == expected
    assert all(len(items) == 1 for items in calls)
    assert sorted(item.num_tokens for items in calls for item in items).count(IMAGE_TOKENS) == 3


def test_a_chunk_stops_before_an_item_that_does_not_fit():
    # A budget of one image: the second image waits for the next step although the token
    # budget has room for both requests' prompts.
    llm = tiny_llm(max_num_encoder_input_tokens=IMAGE_TOKENS, enable_prefix_caching=False)
    engine = llm.engine
    for seed in (1, 2):
        engine.add_request(f"r{seed}", random_prompt(3, seed) + IMAGE + random_prompt(3, seed),
                           greedy(), {"image": [image(seed)]})
    first = engine.scheduler.schedule().scheduled
    # 3 + 18 + 3 tokens; r2 stops before its image's first token (after the delimiter).
    assert [s.num_new_tokens for s in first] == [24, 4]
    second_request = first[1].request
    assert second_request.prompt_token_ids[3] != IMAGE_ID
    assert second_request.prompt_token_ids[4] == IMAGE_ID


def test_default_budget_is_the_step_budget():
    args = EngineArgs(max_num_batched_tokens=512)
    assert args.resolve_max_num_encoder_input_tokens() == 512
    assert EngineArgs().encoder_cache_bytes == 256 * 2**20
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        EngineArgs(max_num_encoder_input_tokens=0).validate()
    with pytest.raises(ValueError, match="encoder_cache_gb"):
        EngineArgs(encoder_cache_gb=-1.0).validate()


def test_cli_flags_reach_the_engine_args():
    import argparse

    from muse.server.launch import add_serve_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, "muse-spark-tiny")
    args = engine_args_from(parser.parse_args(
        ["--max-num-encoder-input-tokens", "64", "--encoder-cache-gb", "0.5"]))
    assert args.max_num_encoder_input_tokens == 64
    assert args.encoder_cache_bytes == 2**29


# ---- pins ------------------------------------------------------------------------------------
def item_range(item) -> tuple[int, int]:
    return item.spans[0][0], item.spans[-1][0] + item.spans[-1][1]


def test_a_chunked_item_is_pinned_until_passed():
    llm = tiny_llm(max_num_batched_tokens=7, enable_prefix_caching=False,
                   max_num_encoder_input_tokens=64)
    engine, cache = llm.engine, llm.engine.encoder_cache
    ids = random_prompt(5, 1) + IMAGE + random_prompt(4, 2) + AUDIO + random_prompt(10, 3)
    (request,) = engine.add_request("a", ids, greedy(),
                                    {"image": [image(1)], "audio": [clip(6, seconds=1.0)]})
    seen_pinned = set()
    while engine.has_unfinished():
        computed = request.num_computed_tokens
        engine.step()
        # The step's schedule pinned what the request was in the middle of.
        for item in request.media:
            first, end = item_range(item)
            inside = first < computed < end
            assert cache.pin_count(item.content_hash) == int(inside)
            if inside:
                seen_pinned.add(item.kind)
    assert seen_pinned == {"image", "audio"}
    assert all(cache.pin_count(item.content_hash) == 0 for item in request.media)


def test_abort_and_preemption_unpin():
    llm = tiny_llm(max_num_batched_tokens=7, enable_prefix_caching=False,
                   max_num_encoder_input_tokens=64)
    engine, cache = llm.engine, llm.engine.encoder_cache
    ids = random_prompt(5, 1) + IMAGE + random_prompt(20, 2)
    (request,) = engine.add_request("a", ids, greedy(), {"image": [image(1)]})
    key = request.media[0].content_hash
    while not cache.pin_count(key):
        engine.step()
    engine.scheduler._preempt(request)  # as a full KV cache would
    assert cache.pin_count(key) == 0
    while not cache.pin_count(key):
        engine.step()  # recomputed from the start, pinned again mid-way
    engine.abort("a")
    assert cache.pin_count(key) == 0
    assert not engine.scheduler.pins.held("a")


def test_pins_keep_a_chunked_item_from_eviction():
    # The cache holds one image's output and a half. While the request is in the middle of
    # its image, other outputs arrive (as other requests' would): they find no room, and the
    # image is encoded once, not again for its next chunk.
    image_bytes = IMAGE_TOKENS * 64 * 4  # tokens x hidden x float32
    llm = tiny_llm(max_num_batched_tokens=7, enable_prefix_caching=False,
                   max_num_encoder_input_tokens=64, encoder_cache_gb=1.5 * image_bytes / 2**30)
    engine, cache = llm.engine, llm.engine.encoder_cache
    calls = record_encodes(llm)
    ids = random_prompt(5, 1) + IMAGE + random_prompt(5, 2)
    (request,) = engine.add_request("a", ids, greedy(), {"image": [image(1)]})
    key = request.media[0].content_hash
    crowded = 0
    while engine.has_unfinished():
        engine.step()
        if cache.pin_count(key):
            assert not cache.put(f"other-{crowded}", torch.zeros(IMAGE_TOKENS, 64))
            crowded += 1
            assert key in cache
    assert crowded >= 2  # the image spans three 7-token chunks
    assert [item.content_hash for items in calls for item in items] == [key]
    expected = tiny_llm(enable_prefix_caching=False).generate(
        [{"prompt_token_ids": ids, "multi_modal_data": {"image": [image(1)]}}], greedy(),
        use_tqdm=False)
    assert request.output_token_ids == expected[0].outputs[0].token_ids

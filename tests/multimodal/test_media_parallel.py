"""Media requests with several ranks (CPU, gloo): greedy output equals the one-process
engine's, token for token.

The other ranks get each new request's media items in the step message and rebuild the
step's media slices from their mirror of the requests; each first-stage rank encodes with its
own copy of the encoders (drawn from the engine's seed) through its own cache. Chunked prefill
cuts the image and audio spans across steps, and text requests share the steps.
"""

from __future__ import annotations

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.step_message import (CachedRequestData, NewRequestData, RequestMirror,
                                      StepDelta, decode_delta, decode_media, encode_delta,
                                      encode_media)
from muse.init_checkpoint import init_random_checkpoint
from muse.multimodal.engine_inputs import media_slices
from muse.multimodal.processor import ProcessedMedia
from muse.multimodal.vision import PatchGrid
from muse.presets import get_preset
from tests.engine.helpers import random_prompt
from tests.multimodal.test_engine_media import clip, image, media_prompt

MAX_TOKENS = 6
PRESET = "muse-spark-tiny"
INIT_STD = 0.1  # wide enough greedy gaps
# The parallel layouts that run media steps; each runs every request below with small
# chunks (spans cut across steps) and several requests per step (pipeline micro-batches,
# both data-parallel ranks busy).
LAYOUTS = {
    "tp2": {"tensor_parallel_size": 2},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2xpp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp2xep": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "pcp2": {"prefill_context_parallel_size": 2},
}


def requests() -> list[dict]:
    """Two media requests (the second reuses the first's image, a cache hit on the ranks that
    encoded it) and two text requests."""
    return [
        {"prompt_token_ids": media_prompt(1), "multi_modal_data":
            {"image": [image(0)], "audio": [clip(5)]}},
        {"prompt_token_ids": random_prompt(30, 9)},
        {"prompt_token_ids": media_prompt(2), "multi_modal_data":
            {"image": [image(0)], "audio": [clip(1)]}},
        {"prompt_token_ids": random_prompt(12, 4)},
    ]


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids
            for out in llm.generate(requests(), params, use_tqdm=False)]


def engine(model: str = PRESET, **engine_args) -> LLM:
    engine_args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    if model == PRESET:
        engine_args["init_std"] = INIT_STD
    return LLM(model, device="cpu", dtype="float32", enable_prefix_caching=False,
               **engine_args)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    llm = engine()
    try:
        return generate(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_media_with_several_ranks_equals_one_process(expected, layout):
    # 9-token steps cut the 16 image tokens and the audio tokens across steps.
    llm = engine(max_num_batched_tokens=9, **LAYOUTS[layout])
    try:
        assert llm.engine.replicas[0].media_kinds() == ["image", "video", "audio"]
        assert generate(llm) == expected
        stats = llm.engine.replicas[0].encoder_cache_stats()
    finally:
        llm.shutdown()
    assert stats  # rank 0 encoded (or found) the items of its requests


def test_checkpoint_encoders_load_on_every_rank(expected, tmp_path):
    """A checkpoint folder's encoders (the preset's, written by `muse init`) are read by each
    rank's worker; the output equals the preset's one-process engine."""
    directory = init_random_checkpoint(get_preset(PRESET), tmp_path / "tiny", seed=0,
                                       dtype="float32", std=INIT_STD)
    llm = engine(str(directory), tensor_parallel_size=2, max_num_batched_tokens=9)
    try:
        assert generate(llm) == expected
    finally:
        llm.shutdown()


# ---- the step message's media, without processes --------------------------------------------
def item(kind: str, data: torch.Tensor, spans: list[tuple[int, int]], **extra
         ) -> ProcessedMedia:
    return ProcessedMedia(kind, 0, data, spans, f"hash-{kind}", **extra)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_media_items_travel_whole(dtype):
    video = item("video", torch.randn(4, 3, 28, 56).to(dtype), [(3, 2), (7, 2)],
                 grid=PatchGrid(2, 2, 4), timestamps=[0.0, 1.5])
    (sent,) = encode_media([video], start=0)
    back = decode_media(sent)
    assert back.kind == "video" and back.data.dtype == dtype
    assert torch.equal(back.data, video.data)
    assert back.spans == video.spans and back.content_hash == video.content_hash
    assert back.grid == video.grid and back.timestamps == video.timestamps


def test_only_items_still_ahead_are_sent():
    first = item("image", torch.zeros(3, 28, 28), [(2, 4)])
    second = item("audio", torch.zeros(1920), [(10, 1)])
    assert [m.kind for m in encode_media([first, second], start=6)] == ["audio"]
    assert encode_media([first, second], start=11) == []


def test_mirror_rebuilds_the_drivers_slices():
    """Two requests in one step, the first cut mid-span: the mirror's slices are the
    runner's (same offsets and rows), and a later step of the first request reuses its item."""
    audio = item("audio", torch.randn(1920 * 5), [(3, 5)])
    picture = item("image", torch.randn(3, 28, 28), [(1, 1)])
    mirror = RequestMirror(["full"])
    step = StepDelta([NewRequestData("a", 0, 6, list(range(6)), [[1]],
                                     encode_media([audio], 0)),
                      NewRequestData("b", 0, 4, list(range(4)), [[2]],
                                     encode_media([picture], 0))], [])
    step = decode_delta(encode_delta(step))
    mirror.apply(step)
    got = mirror.step_media(step)
    want = media_slices([audio], 0, 6, 0) + media_slices([picture], 0, 4, 6)
    assert [(s.offset, s.source_start, s.length) for s in got] == \
        [(s.offset, s.source_start, s.length) for s in want]
    assert torch.equal(got[0].item.data, audio.data)
    held = mirror.media["a"][0]
    later = StepDelta([CachedRequestData("a", 6, 3, [6, 7, 8], [])], ["b"])
    mirror.apply(later)
    (rest,) = mirror.step_media(later)
    assert rest.item is held and (rest.offset, rest.source_start, rest.length) == (0, 3, 2)
    # Both requests' items are behind them now ("b" finished; "a" passed its audio).
    assert mirror.media == {}

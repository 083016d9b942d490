"""Encoder outputs in the engine's inputs: greedy output with media equals the reference
decoder fed the same scattered embeddings, also when chunked prefill cuts a media span, and
the prefix cache shares KV only between requests with the same media."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from muse import SamplingParams
from muse.chat_format import (AUDIO_END_ID, AUDIO_ID, AUDIO_START_ID, IMAGE_END_ID, IMAGE_ID,
                              IMAGE_START_ID)
from muse.engine.errors import InvalidRequestError
from muse.multimodal.engine_inputs import build_media_encoders, media_slices
from muse.multimodal.processor import MuseSparkProcessor
from tests.engine.helpers import (MIN_GREEDY_GAP, random_prompt, reference_from_engine,
                                  reference_greedy, tiny_llm)

MAX_TOKENS = 6
IMAGE = [IMAGE_START_ID, IMAGE_ID, IMAGE_END_ID]
AUDIO = [AUDIO_START_ID, AUDIO_ID, AUDIO_END_ID]


def image(seed: int, size: tuple[int, int] = (112, 112)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


def clip(seed: int, seconds: float = 0.5) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(int(24_000 * seconds))).astype(np.float32)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


@pytest.fixture(scope="module")
def oracle(llm):
    """(reference decoder, encoders, processor) with the engine's weights."""
    engine = llm.engine
    encoders = build_media_encoders(engine.model_config, engine.args.seed, torch.float32, "cpu")
    return reference_from_engine(engine), encoders, MuseSparkProcessor(engine.model_config)


@torch.no_grad()
def reference_media_greedy(oracle, ids: list[int], data: dict) -> tuple[list[int], list[int]]:
    """(expanded ids, greedy tokens) of the reference decoder fed input embeddings with each
    item's encoder output at its spans."""
    reference, encoders, processor = oracle
    out = processor(ids, images=data.get("image", []), audios=data.get("audio", []))
    embeds = reference.model.embed_tokens(torch.tensor(out.input_ids))
    for piece in media_slices(out.media, 0, len(out.input_ids), 0):
        rows = encoders.encode([piece.item])[0]
        embeds[piece.offset:piece.offset + piece.length] = \
            rows[piece.source_start:piece.source_start + piece.length]
    tokens = []
    for _ in range(MAX_TOKENS):
        logits = reference(inputs_embeds=embeds[None]).logits[0, -1]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) > MIN_GREEDY_GAP, "a near tie: pick other media"
        token = int(logits.argmax())
        tokens.append(token)
        embeds = torch.cat([embeds, reference.model.embed_tokens(torch.tensor([token]))])
    return out.input_ids, tokens


def media_prompt(seed: int) -> list[int]:
    return random_prompt(5, seed) + IMAGE + random_prompt(4, seed + 1) + AUDIO \
        + random_prompt(20, seed + 2)


def test_image_and_audio_match_the_reference(llm, oracle):
    ids = media_prompt(1)
    data = {"image": [image(0)], "audio": [clip(5)]}
    expanded, expected = reference_media_greedy(oracle, ids, data)
    (out,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": data}], greedy(),
                          use_tqdm=False)
    assert out.prompt_token_ids == expanded
    assert expanded.count(IMAGE_ID) == 16 and expanded.count(AUDIO_ID) > 1
    assert out.outputs[0].token_ids == expected


def test_chunked_prefill_splits_the_media_spans(oracle):
    ids = media_prompt(2)
    data = {"image": [image(1)], "audio": [clip(1)]}
    _, expected = reference_media_greedy(oracle, ids, data)
    # 7-token chunks cut the 16 image tokens and the audio tokens across steps, and a
    # text-only request shares the steps.
    chunked = tiny_llm(max_num_batched_tokens=7, enable_prefix_caching=False)
    text = random_prompt(30, 9)
    outs = chunked.generate([{"prompt_token_ids": ids, "multi_modal_data": data},
                             {"prompt_token_ids": text}], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected
    reference_tokens, gap = reference_greedy(oracle[0], [text], MAX_TOKENS)
    assert gap > MIN_GREEDY_GAP
    assert outs[1].outputs[0].token_ids == reference_tokens[0]


def test_prefix_cache_keys_include_the_media(llm, oracle):
    ids = random_prompt(5, 3) + IMAGE + random_prompt(30, 4)  # 52 tokens: 3 full blocks

    def run(picture: Image.Image):
        (out,) = llm.generate([{"prompt_token_ids": ids, "multi_modal_data":
                                {"image": picture}}], greedy(), use_tqdm=False)
        return out

    first = run(image(10))
    other = run(image(11))  # the same ids after expansion, another image
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens == 0
    assert other.outputs[0].token_ids == reference_media_greedy(
        oracle, ids, {"image": [image(11)]})[1]
    again = run(image(10))
    assert again.num_cached_tokens == 48
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_text_requests_are_unaffected(llm, oracle):
    prompt = random_prompt(40, 5)
    (out,) = llm.generate([prompt], greedy(), use_tqdm=False)
    expected, gap = reference_greedy(oracle[0], [prompt], MAX_TOKENS)
    assert gap > MIN_GREEDY_GAP
    assert out.outputs[0].token_ids == expected[0]


def test_media_errors_name_the_field(llm):
    with pytest.raises(InvalidRequestError, match="placeholder"):
        llm.generate([{"prompt_token_ids": random_prompt(5, 0),
                       "multi_modal_data": {"image": [image(0)]}}], use_tqdm=False)
    ids = random_prompt(5, 0) + AUDIO
    with pytest.raises(InvalidRequestError, match="1 audio item"):  # a bare array: one clip
        llm.generate([{"prompt_token_ids": ids + AUDIO, "multi_modal_data": {"audio": clip(0)}}],
                     use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="multi_modal_data keys"):
        llm.generate([{"prompt_token_ids": random_prompt(5, 0) + IMAGE,
                       "multi_modal_data": {"images": [image(0)]}}], use_tqdm=False)

"""The server's media plumbing without a live server: decoded media through the engine
message and back, the content-part checks, placeholder rendering, decoding errors as 400s
naming the part, and the encoder-cache metrics."""

from __future__ import annotations

import asyncio
import base64
import io

import msgspec
import numpy as np
import pytest
from PIL import Image

from muse.engine.errors import InvalidRequestError
from muse.engine.sampling_params import SamplingParams
from muse.multimodal.encoder_cache import METRIC_ENTRIES, METRIC_HITS, METRIC_MISSES
from muse.multimodal.media import (DEFAULT_LIMIT_MM_PER_PROMPT, Audio, MediaLimits, Video,
                                   parse_mm_limits, parse_video_fps)
from muse.server.errors import APIError
from muse.server.messages import (AddRequest, EngineReady, EngineStats, MediaArray, ToEngine,
                                  multi_modal_data)
from muse.server.metrics import ServerMetrics
from muse.server.protocol import ChatMessage
from muse.server.serving import MediaPart, check_media, decode_media, placeholder_content

ALL_KINDS = EngineReady(model="m", vocab_size=10, max_model_len=10, max_num_seqs=1,
                        eos_token_ids=[2], media_kinds=["image", "video", "audio"])


def png_url(width: int = 8, height: int = 6) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def user(*parts: dict) -> list[ChatMessage]:
    return [ChatMessage(role="user", content=list(parts))]


def test_media_crosses_the_engine_message_as_raw_arrays():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    frames = rng.integers(0, 256, (3, 4, 4, 3), dtype=np.uint8)
    wave = rng.standard_normal(100).astype(np.float32)
    media = [MediaArray.of(Image.fromarray(pixels)),
             MediaArray.of(Video(frames, np.array([0.0, 0.5, 1.0]))),
             MediaArray.of(Audio(wave, 24_000))]
    sent = AddRequest("r", [1, 2], SamplingParams(), media)
    received = msgspec.msgpack.Decoder(ToEngine).decode(msgspec.msgpack.encode(sent))
    data = multi_modal_data(received.media)
    assert np.array_equal(data["image"][0], pixels)
    assert np.array_equal(data["video"][0].frames, frames)
    assert data["video"][0].timestamps.tolist() == [0.0, 0.5, 1.0]
    assert np.array_equal(data["audio"][0].waveform, wave)
    assert data["audio"][0].sample_rate == 24_000
    assert data["audio"][0].waveform.flags.writeable


def test_a_media_array_whose_bytes_do_not_fit_its_shape_is_refused():
    bad = MediaArray("image", bytes(10), "uint8", [2, 2, 3])
    with pytest.raises(InvalidRequestError, match="do not hold"):
        bad.item()
    with pytest.raises(InvalidRequestError):
        MediaArray("image", bytes(8), "object", [1]).item()


def test_media_parts_are_listed_in_order_and_checked():
    parts = check_media(user(
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": png_url()}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}), ALL_KINDS)
    assert [(p.where, p.kind) for p in parts] == [
        ("messages[0].content[1]", "image"), ("messages[0].content[2]", "audio"),
        ("messages[0].content[3]", "video")]
    with pytest.raises(APIError) as error:
        check_media(user({"type": "input_audio", "input_audio": {"format": "wav"}}),
                     ALL_KINDS)
    assert error.value.param == "messages[0].content[0].input_audio.data"


def test_a_model_without_the_encoder_refuses_the_part():
    no_audio = msgspec.structs.replace(ALL_KINDS, media_kinds=["image", "video"])
    assert check_media(user({"type": "image_url", "image_url": {"url": png_url()}}),
                        no_audio)
    with pytest.raises(APIError) as error:
        check_media(user({"type": "text", "text": "hi"},
                          {"type": "audio_url", "audio_url": {"url": "data:audio/wav,x"}}),
                     no_audio)
    assert (error.value.status, error.value.param) == (400, "messages[0].content[1]")
    assert "no audio input" in error.value.message


def test_the_template_sees_placeholders_not_urls():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA"}}]},
        {"role": "assistant", "content": "b"}]
    assert placeholder_content(messages) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image"},
                                     {"type": "audio"}]},
        {"role": "assistant", "content": "b"}]


def test_decoding_errors_are_400s_naming_the_part():
    good = MediaPart("messages[0].content[0]", "image",
                     {"type": "image_url", "image_url": {"url": png_url()}})
    bad = MediaPart("messages[1].content[2]", "image",
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}})
    (decoded,) = asyncio.run(decode_media([good], MediaLimits(), None))
    assert (decoded.kind, decoded.shape) == ("image", [6, 8, 3])
    with pytest.raises(APIError) as error:
        asyncio.run(decode_media([good, bad], MediaLimits(), None))
    assert (error.value.status, error.value.param) == (400, "messages[1].content[2]")
    assert error.value.message.startswith("messages[1].content[2].image_url")


def test_a_loopback_url_is_a_400():
    part = MediaPart("messages[0].content[0]", "image",
                     {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}})
    with pytest.raises(APIError, match="loopback") as error:
        asyncio.run(decode_media([part], MediaLimits(), None))
    assert error.value.param == "messages[0].content[0]"


def test_encoder_cache_metrics_follow_the_engine_stats():
    metrics = ServerMetrics("m")
    metrics.update_engine(EngineStats(encoder_cache={METRIC_HITS: 2, METRIC_MISSES: 3,
                                                     METRIC_ENTRIES: 3}))
    metrics.update_engine(EngineStats(encoder_cache={METRIC_HITS: 5, METRIC_MISSES: 3,
                                                     METRIC_ENTRIES: 1}))
    text = metrics.render().decode()
    assert 'muse:encoder_cache_hits_total{model_name="m"} 5.0' in text
    assert 'muse:encoder_cache_misses_total{model_name="m"} 3.0' in text
    assert 'muse:encoder_cache_entries{model_name="m"} 1.0' in text


def test_media_parts_past_the_per_prompt_limit_are_refused():
    image = {"type": "image_url", "image_url": {"url": png_url()}}
    assert len(check_media(user(image, image), ALL_KINDS, {"image": 2})) == 2
    with pytest.raises(APIError) as error:
        check_media(user(image, image, image), ALL_KINDS, {"image": 2})
    assert error.value.param == "messages[0].content[2]"
    assert "--limit-mm-per-prompt" in error.value.message


def test_limit_mm_per_prompt_parses_vllms_json():
    assert parse_mm_limits('{"image": 2}') == {**DEFAULT_LIMIT_MM_PER_PROMPT, "image": 2}
    for bad in ("image=2", '{"hologram": 1}', '{"image": -1}', '[1]'):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            parse_mm_limits(bad)


def test_mm_processor_kwargs_flag_sets_the_servers_video_fps():
    import argparse

    from muse.server.launch import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, "muse-spark-tiny")
    assert parser.parse_args(["--mm-processor-kwargs", '{"fps": 1}']).mm_processor_kwargs == 1.0
    assert parser.parse_args([]).mm_processor_kwargs is None
    for bad in ("fps=1", '{"fps": 0}', '{"fps": 1000}', '{"frames": 2}', '[1]'):
        with pytest.raises(ValueError, match="--mm-processor-kwargs"):
            parse_video_fps(bad)

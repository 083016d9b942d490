"""`LLM.chat` with media content parts: decoded items (vLLM's `image_pil`, arrays) and URLs /
base64 parts go to the engine as `multi_modal_data`, the same as `generate` given the
rendered placeholders and the media."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from muse import SamplingParams
from muse.multimodal.media import MediaError
from tests.engine.helpers import tiny_llm

soundfile = pytest.importorskip("soundfile")


def pixels(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)


def png_url(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def wav_base64(waveform: np.ndarray) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, 24_000, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4)


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, *parts]}]


@pytest.fixture(scope="module")
def llm():
    return tiny_llm()


def test_chat_with_media_equals_generate_with_multi_modal_data(llm):
    image = pixels(0)
    clip = (0.2 * np.random.default_rng(1).standard_normal(12_000)).astype(np.float32)
    (chat,) = llm.chat(user({"type": "image_pil", "image_pil": Image.fromarray(image)},
                            {"type": "audio", "audio": clip}), greedy(), use_tqdm=False)
    ids = llm.tokenizer.apply_chat_template(
        user({"type": "image"}, {"type": "audio"}), add_generation_prompt=True, tokenize=True)
    (plain,) = llm.generate([{"prompt_token_ids": ids,
                              "multi_modal_data": {"image": [image], "audio": [clip]}}],
                            greedy(), use_tqdm=False)
    assert chat.prompt_token_ids == plain.prompt_token_ids
    assert len(chat.prompt_token_ids) > len(ids)  # the placeholders were expanded
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_url_and_base64_parts_decode_to_the_same_media(llm):
    image = pixels(2)
    clip = (0.2 * np.random.default_rng(3).standard_normal(12_000)).astype(np.float32)
    by_url = llm.chat(user({"type": "image_url", "image_url": {"url": png_url(image)}},
                           {"type": "input_audio",
                            "input_audio": {"data": wav_base64(clip), "format": "wav"}}),
                      greedy(), use_tqdm=False)[0]
    direct = llm.chat(user({"type": "image_pil", "image_pil": image},
                           {"type": "audio", "audio": clip}), greedy(), use_tqdm=False)[0]
    assert by_url.prompt_token_ids == direct.prompt_token_ids
    assert by_url.outputs[0].token_ids == direct.outputs[0].token_ids
    # The prefix cache keys hold the media's content hashes: equal pixels share the KV of
    # the blocks that hold them, other pixels do not.
    assert direct.num_cached_tokens > 0
    other = llm.chat(user({"type": "image_pil", "image_pil": pixels(5)},
                          {"type": "audio", "audio": clip}), greedy(), use_tqdm=False)[0]
    assert other.num_cached_tokens < direct.num_cached_tokens


def test_several_conversations_each_with_their_media(llm):
    outputs = llm.chat([user({"type": "image_pil", "image_pil": pixels(4)}),
                        [{"role": "user", "content": "no media here"}]], greedy(),
                       use_tqdm=False)
    assert len(outputs) == 2
    assert len(outputs[0].prompt_token_ids) > len(outputs[1].prompt_token_ids)


def test_a_bad_part_raises_naming_it(llm):
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[1\]\.image_url"):
        llm.chat(user({"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}),
                 greedy(), use_tqdm=False)
    with pytest.raises(MediaError, match="loopback"):
        llm.chat(user({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}),
                 greedy(), use_tqdm=False)
    with pytest.raises(MediaError, match=r"^messages\[0\]\.content\[1\]: "):
        llm.chat(user({"type": "image_pil"}), greedy(), use_tqdm=False)


def test_videos_are_sampled_at_the_requested_fps(llm):
    av = pytest.importorskip("av")
    buffer = io.BytesIO()
    # 4 s at 8 frames a second: 4, 8 and 16 frames at 1, 2 and 4 fps (a clip under 2 s gets
    # the floor of 4 frames, MIN_VIDEO_FRAMES, at 1 fps and at 2).
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        for i in range(32):
            frame = np.full((56, 56, 3), 7 * i, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    url = "data:video/mp4;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = user({"type": "video_url", "video_url": {"url": url}})

    def prompt_length(**kwargs) -> int:
        [output] = llm.chat(messages, greedy(), use_tqdm=False, **kwargs)
        return len(output.prompt_token_ids)

    default = prompt_length()  # the model's 2 fps: 8 frames
    assert prompt_length(mm_processor_kwargs={"fps": 2}) == default
    assert prompt_length(mm_processor_kwargs={"fps": 1}) < default \
        < prompt_length(mm_processor_kwargs={"fps": 4})
    for bad in ({"fps": 0}, {"fps": "2"}, {"frames": 4}):
        with pytest.raises(ValueError, match="mm_processor_kwargs"):
            llm.chat(messages, greedy(), use_tqdm=False, mm_processor_kwargs=bad)

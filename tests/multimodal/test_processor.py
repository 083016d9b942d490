"""The multimodal processor: smart resize, token counts against the encoders, placeholder
spans, content hashes, errors and processor_config.json."""

from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from muse.chat_format import (
    AUDIO_END_ID,
    AUDIO_ID,
    AUDIO_START_ID,
    IMAGE_END_ID,
    IMAGE_ID,
    IMAGE_START_ID,
    USER_ID,
    VIDEO_END_ID,
    VIDEO_ID,
    VIDEO_START_ID,
)
from muse.config import ConfigError, MuseSparkConfig
from muse.multimodal import VisionEncoder
from muse.multimodal.audio import num_audio_tokens
from muse.multimodal.media import Audio, Video
from muse.multimodal.processor import (
    PROCESSOR_CONFIG_FILE,
    MuseSparkProcessor,
    ProcessorConfig,
    ProcessorError,
    closest_allowed_size,
    smart_resize,
)
from muse.multimodal.silence import SERVING_LEADING_MARGIN_SECONDS, SILENCE_MARGIN_SECONDS
from muse.presets import SHIPPED_CHECKPOINT, tiny
from muse.tokenizer import MuseTokenizer

MODEL = tiny()
VISION = MODEL.vision_config
FACTOR = VISION.patch_size * VISION.spatial_merge_size  # 28
IMAGE = [IMAGE_START_ID, IMAGE_ID, IMAGE_END_ID]
VIDEO = [VIDEO_START_ID, VIDEO_ID, VIDEO_END_ID]
AUDIO = [AUDIO_START_ID, AUDIO_ID, AUDIO_END_ID]
# Small bounds keep the random encoder fast.
SMALL = ProcessorConfig(min_pixels=FACTOR * FACTOR, max_pixels=FACTOR * FACTOR * 12,
                        video_max_pixels=FACTOR * FACTOR * 4)


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


@pytest.fixture(scope="module")
def processor(tokenizer: MuseTokenizer) -> MuseSparkProcessor:
    return MuseSparkProcessor(MODEL, SMALL, tokenizer)


@pytest.fixture(scope="module")
def encoder() -> VisionEncoder:
    torch.manual_seed(0)
    encoder = VisionEncoder(VISION, MODEL.text.hidden_size)
    with torch.no_grad():
        for parameter in encoder.parameters():
            parameter.normal_(0.0, 0.1)
    return encoder.eval()


def random_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def random_video(frames: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (frames, height, width, 3),
                                                dtype=np.uint8)


# ---------------------------------------------------------------- smart resize

def check_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    new_height, new_width = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
    assert new_height % FACTOR == 0 and new_width % FACTOR == 0
    assert new_height >= FACTOR and new_width >= FACTOR
    assert min_pixels <= new_height * new_width <= max_pixels
    return new_height, new_width


def test_smart_resize_keeps_multiples_bounds_and_aspect_ratio() -> None:
    config = ProcessorConfig()
    rng = random.Random(0)
    for _ in range(2000):
        height, width = rng.randint(20, 6000), rng.randint(20, 6000)
        if max(height, width) / min(height, width) > 8:
            continue
        new_height, new_width = check_size(height, width, config.min_pixels, config.max_pixels)
        # Rounding each side to a multiple of 28 moves the ratio by at most about one step.
        ratio, new_ratio = height / width, new_height / new_width
        tolerance = FACTOR / min(new_height, new_width) * 1.5
        assert abs(np.log(new_ratio / ratio)) <= tolerance, (height, width, new_height,
                                                             new_width)
    # A size already on the grid and inside the bounds is kept.
    assert smart_resize(280, 448, FACTOR, config.min_pixels, config.max_pixels) == (280, 448)


def test_smart_resize_tiny_huge_and_extreme_images() -> None:
    config = ProcessorConfig()
    assert check_size(1, 1, config.min_pixels, config.max_pixels) == (56, 56)
    assert check_size(3, 5, config.min_pixels, config.max_pixels) == (56, 84)
    height, width = check_size(10000, 8000, config.min_pixels, config.max_pixels)
    assert abs(height / width - 1.25) < 0.05
    assert check_size(20000, 20000, config.min_pixels, config.max_pixels) == (980, 980)
    check_size(1, 200, config.min_pixels, config.max_pixels)
    check_size(30000, 150, config.min_pixels, config.max_pixels)
    # The short side stuck at 28: the long side alone shrinks to fit max_pixels.
    assert check_size(10, 2000, FACTOR * FACTOR, 4 * FACTOR * FACTOR) == (28, 112)
    with pytest.raises(ProcessorError, match="aspect ratio"):
        smart_resize(1, 201, FACTOR, config.min_pixels, config.max_pixels)
    with pytest.raises(ProcessorError, match="at least one pixel"):
        smart_resize(0, 10, FACTOR, config.min_pixels, config.max_pixels)


def test_a_narrow_pixel_range_still_takes_any_aspect_ratio() -> None:
    """Video frames at exactly 112^2 (the shipped model's setting): flooring a 4:3 frame's
    sides gives 84x112, below the range; the closest allowed shape is taken instead."""
    exactly = 16 * FACTOR * FACTOR
    for height, width in ((240, 320), (480, 640), (720, 1280), (1080, 1920), (300, 200)):
        assert check_size(height, width, exactly, exactly) == (112, 112)
    assert check_size(100, 1000, exactly, exactly) == (28, 448)  # 1:10, the closest is 1:16
    # Among the allowed sizes the one nearest the aspect ratio (3x5 cells for 2:3: 4x6 is
    # too large), the larger on a tie (4x4 of the exact squares).
    assert closest_allowed_size(200, 300, FACTOR, 12 * FACTOR * FACTOR,
                                20 * FACTOR * FACTOR) == (84, 140)
    assert closest_allowed_size(100, 100, FACTOR, FACTOR * FACTOR,
                                20 * FACTOR * FACTOR) == (112, 112)
    rng = random.Random(1)
    for _ in range(300):
        height, width = rng.randint(20, 3000), rng.randint(20, 3000)
        if max(height, width) / min(height, width) <= 8:
            check_size(height, width, exactly, 2 * exactly)


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="needs the shipped checkpoint")
def test_the_shipped_processor_takes_videos_of_any_aspect_ratio(
        tokenizer: MuseTokenizer) -> None:
    processor = MuseSparkProcessor.from_pretrained(SHIPPED_CHECKPOINT, tokenizer)
    for height, width in ((240, 320), (720, 1280), (96, 96)):
        frames, _ = processor.preprocess_video(random_video(4, height, width))
        assert frames.shape[-2:] == (112, 112)


def test_image_is_resized_and_normalized(processor: MuseSparkProcessor) -> None:
    pixels = random_image(50, 90)
    tensor = processor.preprocess_image(pixels)
    height, width = smart_resize(50, 90, FACTOR, SMALL.min_pixels, SMALL.max_pixels)
    assert tensor.shape == (3, height, width) and tensor.dtype == torch.float32
    assert tensor.min() >= -1.0 and tensor.max() <= 1.0
    # PIL input and an on-grid array (no resampling): exact (x / 255 - 0.5) / 0.5.
    on_grid = random_image(56, 84, seed=3)
    expected = torch.from_numpy(on_grid).permute(2, 0, 1).float() / 127.5 - 1.0
    torch.testing.assert_close(processor.preprocess_image(Image.fromarray(on_grid)), expected)
    torch.testing.assert_close(processor.preprocess_image(torch.from_numpy(on_grid)), expected)


# ---------------------------------------------------------------- counts and spans

def test_image_and_video_token_counts_match_the_encoder(
        processor: MuseSparkProcessor, encoder: VisionEncoder) -> None:
    images = [random_image(50, 90, 1), random_image(300, 40, 2), random_image(5, 7, 3)]
    video = Video(random_video(5, 60, 80, 4), np.array([0.0, 0.5, 1.0, 1.5, 2.0]))
    ids = [USER_ID, *IMAGE, 100, *VIDEO, *IMAGE, 101, *IMAGE]
    out = processor(ids, images=images, videos=[video])
    assert [item.kind for item in out.media] == ["image", "video", "image", "image"]
    vision_items = out.media
    with torch.no_grad():
        encoded = encoder.encode([item.data for item in vision_items])
    for item, result in zip(vision_items, encoded):
        assert item.num_tokens == result.embeddings.shape[0]
        assert item.grid == result.grid
    video_item = out.of_kind("video")[0]
    # 5 frames padded to 6 (the last repeated): 3 frame groups, one span each.
    assert video_item.data.shape[0] == 6
    torch.testing.assert_close(video_item.data[5], video_item.data[4])
    assert video_item.timestamps == [0.0, 1.0, 2.0]
    groups = encoded[1].groups
    assert len(video_item.spans) == groups.shape[0] == 3
    assert all(length == groups.shape[1] for _, length in video_item.spans)


def test_spans_cover_exactly_the_placeholder_tokens(
        processor: MuseSparkProcessor, tokenizer: MuseTokenizer) -> None:
    ids = [USER_ID, *AUDIO, 50, 51, *VIDEO, *IMAGE, 52]
    waveform = torch.randn(5000)
    video = (random_video(4, 56, 56), [3.0, 3.5, 4.0, 4.5])
    out = processor(ids, images=[random_image(60, 60)], videos=[video], audios=[waveform])
    expanded = out.input_ids
    covered = set()
    for item in out.media:
        token = {"image": IMAGE_ID, "video": VIDEO_ID, "audio": AUDIO_ID}[item.kind]
        for start, length in item.spans:
            assert expanded[start:start + length] == [token] * length
            covered.update(range(start, start + length))
    media_positions = {i for i, t in enumerate(expanded) if t in (IMAGE_ID, VIDEO_ID, AUDIO_ID)}
    assert covered == media_positions
    # Everything else is the prompt's own tokens plus the video's time markers.
    audio_item, video_item, image_item = out.media
    assert audio_item.num_tokens == num_audio_tokens(5000, MODEL.audio_config) == 3
    assert expanded[:2] == [USER_ID, AUDIO_START_ID]
    assert expanded[audio_item.spans[0][0] + 3] == AUDIO_END_ID
    marker = tokenizer.encode("<t=3.0s>")
    first_start = video_item.spans[0][0]
    assert expanded[first_start - len(marker) - 1] == VIDEO_START_ID
    assert expanded[first_start - len(marker):first_start] == marker
    second = tokenizer.encode("<t=4.0s>")
    second_start = video_item.spans[1][0]
    assert expanded[second_start - len(second):second_start] == second
    assert tokenizer.decode(expanded[first_start - len(marker):first_start]) == "<t=3.0s>"
    assert expanded[-1] == 52 and expanded[-2] == IMAGE_END_ID
    without_media = [t for i, t in enumerate(expanded) if i not in covered]
    assert without_media == [USER_ID, AUDIO_START_ID, AUDIO_END_ID, 50, 51, VIDEO_START_ID,
                             *marker, *second, VIDEO_END_ID, IMAGE_START_ID, IMAGE_END_ID, 52]


def test_audio_counts_match_num_audio_tokens(processor: MuseSparkProcessor) -> None:
    config = MODEL.audio_config
    for samples in (1, 1919, 1920, 1921, 24000, 24000 * 3 + 7):
        out = processor(AUDIO, audios=[np.zeros(samples, dtype=np.float32)])
        (item,) = out.media
        assert item.spans == [(1, num_audio_tokens(samples, config))]
        assert len(out.input_ids) == 2 + num_audio_tokens(samples, config)
    out = processor(AUDIO, audios=[Audio(np.zeros(4000, dtype=np.float32), 24000)])
    assert out.media[0].num_tokens == 3


def test_audio_silence_is_cut_when_the_config_says_so(tokenizer: MuseTokenizer) -> None:
    rate = MODEL.audio_config.sample_rate
    rng = np.random.default_rng(0)
    speech = (0.5 * rng.standard_normal(rate)).astype(np.float32)
    padded = np.concatenate([np.zeros(rate // 2, np.float32), speech,
                             np.zeros(rate, np.float32)])
    trimming = MuseSparkProcessor(MODEL, dataclasses.replace(SMALL, trim_audio_silence=True),
                                  tokenizer)
    (item,) = trimming(AUDIO, audios=[padded]).media
    lead = int(SERVING_LEADING_MARGIN_SECONDS * rate)
    trail = int(SILENCE_MARGIN_SECONDS * rate)
    assert item.data.shape == (lead + rate + trail,)
    torch.testing.assert_close(item.data[lead:lead + rate], torch.from_numpy(speech))
    (bare,) = trimming(AUDIO, audios=[speech]).media
    assert bare.data.shape == (rate,)  # loud from its first sample to its last: all kept
    (kept,) = MuseSparkProcessor(MODEL, SMALL, tokenizer)(AUDIO, audios=[padded]).media
    assert kept.data.shape == padded.shape  # off by default
    (quiet,) = trimming(AUDIO, audios=[np.zeros(4000, np.float32)]).media
    assert quiet.data.shape == (4000,)  # nothing is loud: the clip stays whole
    with pytest.raises(ConfigError, match="trim_audio_silence"):
        ProcessorConfig(trim_audio_silence="yes")


def test_video_frames_are_capped_and_timestamps_default(tokenizer: MuseTokenizer) -> None:
    config = ProcessorConfig(min_pixels=FACTOR * FACTOR, max_pixels=FACTOR * FACTOR * 4,
                             video_max_pixels=FACTOR * FACTOR, max_video_frames=4,
                             video_fps=2.0)
    processor = MuseSparkProcessor(MODEL, config, tokenizer)
    pixels, times = processor.preprocess_video(random_video(9, 40, 40))
    assert pixels.shape == (4, 3, 28, 28)
    assert times == [0.0, 2.5]  # frames 0, 3, 5, 8 of 9 at 2 fps; groups start at 0 and 5
    pixels, times = processor.preprocess_video(random_video(3, 40, 40))
    assert pixels.shape[0] == 4 and times == [0.0, 1.0]


# ---------------------------------------------------------------- hashes

def test_hashes_equal_for_equal_media_and_differ_for_one_pixel(
        processor: MuseSparkProcessor) -> None:
    image = random_image(56, 56, 7)
    changed = image.copy()
    changed[10, 20, 1] ^= 1
    video = random_video(2, 56, 56, 8)
    changed_video = video.copy()
    changed_video[1, 0, 0, 0] ^= 1
    waveform = np.random.default_rng(0).standard_normal(3000).astype(np.float32)
    changed_waveform = waveform.copy()
    changed_waveform[100] += 0.01
    ids = [*IMAGE, *IMAGE, *VIDEO, *VIDEO, *AUDIO, *AUDIO, *IMAGE]
    out = processor(ids, images=[image, image.copy(), changed],
                    videos=[video, changed_video], audios=[waveform, changed_waveform])
    hashes = {(item.kind, item.index): item.content_hash for item in out.media}
    assert hashes["image", 0] == hashes["image", 1] != hashes["image", 2]
    assert hashes["video", 0] != hashes["video", 1]
    assert hashes["audio", 0] != hashes["audio", 1]
    again = processor([*AUDIO], audios=[torch.from_numpy(waveform.copy())])
    assert again.media[0].content_hash == hashes["audio", 0]
    # The same pixels as a one-frame-group video and as an image hash apart.
    assert len(set(hashes.values())) == 6


# ---------------------------------------------------------------- errors

def test_mismatched_counts_name_the_kind(processor: MuseSparkProcessor) -> None:
    image = random_image(56, 56)
    with pytest.raises(ProcessorError, match="2 image placeholder.*1 image item"):
        processor([*IMAGE, *IMAGE], images=[image])
    with pytest.raises(ProcessorError, match="0 video placeholder.*1 video item"):
        processor([*IMAGE], images=[image], videos=[random_video(2, 56, 56)])
    with pytest.raises(ProcessorError, match="1 audio placeholder.*0 audio item"):
        processor([*AUDIO])
    already = processor([*IMAGE], images=[image]).input_ids
    with pytest.raises(ProcessorError, match="already expanded"):
        processor(already + IMAGE, images=[image, image])


def test_wrong_media_types_and_bad_audio(processor: MuseSparkProcessor) -> None:
    with pytest.raises(ProcessorError, match=r"images\[0\] is a Audio"):
        processor(IMAGE, images=[Audio(np.zeros(10, dtype=np.float32), 24000)])
    with pytest.raises(ProcessorError, match=r"videos\[0\] is a Image"):
        processor(VIDEO, videos=[Image.new("RGB", (56, 56))])
    with pytest.raises(ProcessorError, match="PIL image or a uint8 array"):
        processor(IMAGE, images=["cat.png"])
    with pytest.raises(ProcessorError, match="uint8"):
        processor(IMAGE, images=[np.zeros((56, 56, 3), dtype=np.float32)])
    with pytest.raises(ProcessorError, match=r"uint8 \[T, H, W, 3\]"):
        processor(VIDEO, videos=[random_image(56, 56)])
    with pytest.raises(ProcessorError, match="mono"):
        processor(AUDIO, audios=[torch.zeros(2, 100)])
    with pytest.raises(ProcessorError, match="floating point"):
        processor(AUDIO, audios=[np.zeros(100, dtype=np.int16)])
    with pytest.raises(ProcessorError, match="24000 Hz; got 16000 Hz"):
        processor(AUDIO, audios=[Audio(np.zeros(100, dtype=np.float32), 16000)])
    with pytest.raises(ProcessorError, match="one timestamp per frame"):
        processor(VIDEO, videos=[(random_video(2, 56, 56), [0.0])])
    no_tokenizer = MuseSparkProcessor(MODEL, SMALL)
    with pytest.raises(ProcessorError, match="need a tokenizer"):
        no_tokenizer(VIDEO, videos=[random_video(2, 56, 56)])


# ---------------------------------------------------------------- config file

def test_config_round_trip_and_defaults(tmp_path) -> None:
    assert ProcessorConfig.load(tmp_path) == ProcessorConfig()
    config = ProcessorConfig(min_pixels=1000, max_pixels=200_000, video_max_pixels=50_000,
                             video_fps=1.5, max_video_frames=16, image_mean=(0.48, 0.46, 0.41),
                             image_std=(0.27, 0.26, 0.28), resample="bilinear",
                             time_marker="<{seconds:.2f}>")
    config.save(tmp_path)
    data = json.loads((tmp_path / PROCESSOR_CONFIG_FILE).read_text())
    assert data["image_mean"] == [0.48, 0.46, 0.41] and data["video_fps"] == 1.5
    assert ProcessorConfig.load(tmp_path) == config
    MODEL.save(tmp_path)
    loaded = MuseSparkProcessor.from_pretrained(tmp_path)
    assert loaded.config == config and loaded.tokenizer is None
    (tmp_path / PROCESSOR_CONFIG_FILE).write_text(json.dumps({"min_pixel": 5}))
    with pytest.raises(ConfigError, match="min_pixel"):
        ProcessorConfig.load(tmp_path)
    with pytest.raises(ConfigError, match="max_pixels"):
        ProcessorConfig(min_pixels=1000, max_pixels=999)
    with pytest.raises(ConfigError, match="time_marker"):
        ProcessorConfig(time_marker="<t={when}>")
    with pytest.raises(ConfigError, match="image_std"):
        ProcessorConfig(image_std=(0.5, 0.0, 0.5))


def test_chat_template_prompt_expands(processor: MuseSparkProcessor,
                                      tokenizer: MuseTokenizer) -> None:
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": "data:"}},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
        {"type": "text", "text": "please <|image|>"},
    ]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert ids.count(IMAGE_ID) == 1  # the user's literal "<|image|>" is text
    out = processor(ids, images=[random_image(56, 84)], audios=[torch.zeros(2000)])
    image_item, audio_item = out.media
    assert image_item.spans[0][1] == 6 and audio_item.spans[0][1] == 2
    assert len(out.input_ids) == len(ids) - 2 + 6 + 2


def test_a_model_without_encoders_refuses_media() -> None:
    processor = MuseSparkProcessor(MuseSparkConfig())
    with pytest.raises(ProcessorError, match="no vision encoder"):
        processor(IMAGE, images=[random_image(56, 56)])
    with pytest.raises(ProcessorError, match="no audio encoder"):
        processor(AUDIO, audios=[torch.zeros(100)])
    assert processor([USER_ID, 100]).input_ids == [USER_ID, 100]

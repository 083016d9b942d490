"""The multimodal processor: decoded media -> encoder inputs, and placeholders -> token spans.

The chat template writes one placeholder per media part (`<|image_start|><|image|>
<|image_end|>`, the same for video and audio). The processor turns each image, video and
audio clip into what its encoder takes, and expands each placeholder token into as many
tokens as that encoder produces, so the engine can scatter the encoder's outputs there:

- An image (PIL image, or uint8 array / tensor [H, W, 3]) is resized with Qwen2-VL's
  `smart_resize` rule: sides multiples of `patch_size * spatial_merge_size` (28), area in
  [min_pixels, max_pixels], aspect ratio kept as closely as that allows. Pixels are scaled
  to [0, 1] and normalized per channel with `image_mean` / `image_std` (0.5 / 0.5 by default,
  so values lie in [-1, 1]) into a float32 tensor [C, H, W]. Its placeholder becomes
  patches / merge^2 image tokens.
- A video (`muse.multimodal.media.Video`, a (frames, timestamps) pair, or frames alone,
  [T, H, W, 3] uint8) keeps at most `max_video_frames` frames (sampled evenly), every frame
  is resized to one size (area within [min_pixels, video_max_pixels]), and T is padded to a
  multiple of `temporal_patch_size` by repeating the last frame: [T, C, H, W]. Its placeholder
  becomes, for each frame group, a time marker followed by that group's video tokens. The
  marker is ordinary text, `time_marker.format(seconds=...)` (default `<t=1.0s>`: the
  timestamp of the group's first frame, one decimal), tokenized with special-token strings
  spelled as text. Without timestamps, frame i is at i / video_fps seconds.
- An audio clip (`muse.multimodal.media.Audio`, or a 1-D float array / tensor at the audio
  encoder's 24 kHz; resampling is `muse.multimodal.media`'s job) becomes a float32 tensor
  [samples], its leading and trailing silence cut when the config says `trim_audio_silence`,
  and its placeholder `num_audio_tokens(samples)` audio tokens.

Each item also gets its spans, (start, length) of its media tokens in the expanded ids (one
span per frame group for a video, markers excluded; one span otherwise), and a content hash:
blake2b over the kind, dtype, shape and bytes of the encoder input. Equal hashes mean equal
encoder outputs (the hash is taken after resizing and normalization, so it also covers the
processor settings), which is what the encoder cache and the prefix-cache keys need.

The processor's settings are a `ProcessorConfig`, stored as `processor_config.json` next to a
checkpoint's `config.json`; a checkpoint without one gets the defaults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from muse.chat_format import (
    AUDIO_END_ID,
    AUDIO_START_ID,
    IMAGE_END_ID,
    IMAGE_START_ID,
    VIDEO_END_ID,
    VIDEO_START_ID,
)
from muse.config import AudioConfig, ConfigError, MuseSparkConfig, VisionConfig
from muse.multimodal.audio import num_audio_tokens
from muse.multimodal.media import Audio, Video, to_rgb
from muse.multimodal.silence import SERVING_LEADING_MARGIN_SECONDS, trim_silence
from muse.multimodal.vision import PatchGrid

PROCESSOR_CONFIG_FILE = "processor_config.json"
KINDS = ("image", "video", "audio")
# Qwen2-VL refuses images longer than this many times their width (or the reverse).
MAX_ASPECT_RATIO = 200.0
_RESAMPLING = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR,
               "lanczos": Image.Resampling.LANCZOS, "nearest": Image.Resampling.NEAREST}


class ProcessorError(ValueError):
    """A request's media do not fit its prompt, or are not what the encoders take."""


@dataclass
class ProcessorConfig:
    """Resizing, normalization and video sampling; `processor_config.json` on disk."""

    min_pixels: int = 56 * 56  # smallest image / frame area after resizing
    max_pixels: int = 28 * 28 * 1280  # largest image area: 1280 tokens at merge 2, patch 14
    video_max_pixels: int = 28 * 28 * 256  # largest area of one video frame: 256 tokens / group
    video_fps: float = 2.0  # frames a second `muse.multimodal.media` samples a video at
    max_video_frames: int = 32
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    resample: str = "bicubic"  # Pillow filter: bicubic, bilinear, lanczos or nearest
    time_marker: str = "<t={seconds:.1f}s>"  # text before each video frame group
    # Cut each audio clip's leading and trailing silence (muse.multimodal.silence), for a
    # model trained on clips cut that way.
    trim_audio_silence: bool = False

    def __post_init__(self) -> None:
        self.image_mean = tuple(float(x) for x in self.image_mean)
        self.image_std = tuple(float(x) for x in self.image_std)
        for name in ("min_pixels", "max_pixels", "video_max_pixels", "max_video_frames"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value > 0, name,
                   "a positive integer", value)
        for name in ("max_pixels", "video_max_pixels"):
            _check(getattr(self, name) >= self.min_pixels, name,
                   f">= min_pixels={self.min_pixels}", getattr(self, name))
        _check(isinstance(self.video_fps, (int, float)) and self.video_fps > 0, "video_fps",
               "a positive number", self.video_fps)
        _check(len(self.image_mean) == len(self.image_std) > 0, "image_std",
               f"as many values as image_mean ({len(self.image_mean)})", list(self.image_std))
        _check(all(std > 0 for std in self.image_std), "image_std", "positive values",
               list(self.image_std))
        _check(isinstance(self.trim_audio_silence, bool), "trim_audio_silence", "true or false",
               self.trim_audio_silence)
        _check(self.resample in _RESAMPLING, "resample", f"one of {sorted(_RESAMPLING)}",
               self.resample)
        try:
            self.time_marker.format(seconds=0.0)
        except (KeyError, IndexError, ValueError, AttributeError) as error:
            raise ConfigError(f"processor config field `time_marker` must be a format string "
                              f"with one field {{seconds}}, got {self.time_marker!r} "
                              f"({error!r})") from None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["image_mean"], data["image_std"] = list(self.image_mean), list(self.image_std)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProcessorConfig:
        data = {key: value for key, value in data.items() if key != "processor_class"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _check(not unknown, PROCESSOR_CONFIG_FILE, f"made of the fields {sorted(known)}",
               unknown)
        return cls(**data)

    def save(self, directory: str | Path) -> None:
        """`directory/processor_config.json`, the folder made if needed."""
        path = Path(directory) / PROCESSOR_CONFIG_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"processor_class": "MuseSparkProcessor", **self.to_dict()}
        path.write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ProcessorConfig:
        """The folder's `processor_config.json`, or the defaults when it has none."""
        path = Path(directory) / PROCESSOR_CONFIG_FILE
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path} is not valid JSON: {error}") from None
        _check(isinstance(data, dict), PROCESSOR_CONFIG_FILE, "a JSON object", type(data).__name__)
        return cls.from_dict(data)


def preset_processor_config(preset: str | None) -> ProcessorConfig:
    """The processor settings a preset's checkpoints get (`muse.presets.PROCESSOR_SETTINGS`),
    the defaults for other presets and names."""
    from muse.presets import PROCESSOR_SETTINGS

    return ProcessorConfig(**PROCESSOR_SETTINGS.get(preset or "", {}))


def _check(condition: bool, name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"processor config field `{name}` must be {allowed}, got {value!r}")


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The (height, width) an image is resized to (Qwen2-VL's rule).

    Each side is rounded to the nearest multiple of `factor` (at least `factor`); if the area
    is then above `max_pixels` both sides are scaled down by the same ratio and floored to
    multiples, if below `min_pixels` scaled up and ceiled. When the short side is already at
    `factor` (aspect ratios near MAX_ASPECT_RATIO with a small max_pixels) the long side alone
    is shortened, so the area bounds always hold.
    """
    if height < 1 or width < 1:
        raise ProcessorError(f"an image needs at least one pixel each way; got {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ProcessorError(f"an image's aspect ratio must be at most {MAX_ASPECT_RATIO:g}; "
                             f"got {height}x{width}")
    if max_pixels < factor * factor or max_pixels < min_pixels:
        raise ProcessorError(f"max_pixels={max_pixels} must be at least min_pixels="
                             f"{min_pixels} and factor^2 = {factor * factor}")
    new_height = max(factor, round(height / factor) * factor)
    new_width = max(factor, round(width / factor) * factor)
    if new_height * new_width > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        new_height = max(factor, math.floor(height / beta / factor) * factor)
        new_width = max(factor, math.floor(width / beta / factor) * factor)
    elif new_height * new_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        new_height = math.ceil(height * beta / factor) * factor
        new_width = math.ceil(width * beta / factor) * factor
    while new_height * new_width > max_pixels:  # only when a side was clamped to `factor`
        if new_height >= new_width:
            new_height -= factor
        else:
            new_width -= factor
    if new_height * new_width < min_pixels:
        # A narrow range (a video's frames at exactly 112^2) that flooring both sides missed:
        # a 240x320 frame floors to 84x112, below it.
        return closest_allowed_size(height, width, factor, min_pixels, max_pixels)
    return new_height, new_width


def closest_allowed_size(height: int, width: int, factor: int, min_pixels: int,
                         max_pixels: int) -> tuple[int, int]:
    """Of the sizes with sides multiples of `factor` and an area in [min_pixels, max_pixels],
    the one whose aspect ratio is closest to height x width's (the larger on a tie)."""
    cell = factor * factor
    fewest, most = math.ceil(min_pixels / cell), max_pixels // cell
    aspect = math.log(height / width)
    best: tuple[tuple[float, int], int, int] | None = None
    for rows in range(1, most + 1):
        low, high = max(1, math.ceil(fewest / rows)), most // rows
        if low > high:
            continue
        ideal = rows * width / height  # the columns that keep the aspect ratio
        for columns in {min(max(low, math.floor(ideal)), high),
                        min(max(low, math.ceil(ideal)), high)}:
            key = (abs(math.log(rows / columns) - aspect), -rows * columns)
            if best is None or key < best[0]:
                best = (key, rows, columns)
    if best is None:
        raise ProcessorError(f"no size with sides multiples of {factor} has an area in "
                             f"[{min_pixels}, {max_pixels}]; widen the range")
    return best[1] * factor, best[2] * factor


@dataclass
class ProcessedMedia:
    """One image, video or audio clip of a prompt, ready for its encoder."""

    kind: str  # "image", "video" or "audio"
    index: int  # position among the prompt's media of this kind
    data: torch.Tensor  # image [C, H, W], video [T, C, H, W] (normalized float32); audio [samples]
    spans: list[tuple[int, int]]  # (start, length) of its media tokens in the expanded ids
    content_hash: str  # hex blake2b of the encoder input (kind, dtype, shape, bytes)
    grid: PatchGrid | None = None  # images and videos
    timestamps: list[float] | None = None  # a video's frame groups, seconds

    @property
    def num_tokens(self) -> int:
        return sum(length for _, length in self.spans)


@dataclass
class ProcessorOutput:
    input_ids: list[int]
    media: list[ProcessedMedia] = field(default_factory=list)  # in prompt order

    def of_kind(self, kind: str) -> list[ProcessedMedia]:
        return [item for item in self.media if item.kind == kind]


def content_hash(kind: str, data: torch.Tensor) -> str:
    """blake2b (128-bit, hex) of an encoder input with its kind, dtype and shape."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{kind}|{data.dtype}|{tuple(data.shape)}|".encode())
    digest.update(data.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class MuseSparkProcessor:
    """Media -> encoder inputs, and a prompt's placeholders -> media token spans."""

    def __init__(self, model_config: MuseSparkConfig, config: ProcessorConfig | None = None,
                 tokenizer: Any = None) -> None:
        self.config = config or ProcessorConfig()
        self.vision: VisionConfig | None = model_config.vision_config
        self.audio: AudioConfig | None = model_config.audio_config
        self.tokenizer = tokenizer  # needed for video time markers: encode_as_text or encode
        text = model_config.text_config
        self.token_ids = {"image": text.image_token_id, "video": text.video_token_id,
                          "audio": text.audio_token_id}
        self.delimiters = {"image": (IMAGE_START_ID, IMAGE_END_ID),
                           "video": (VIDEO_START_ID, VIDEO_END_ID),
                           "audio": (AUDIO_START_ID, AUDIO_END_ID)}
        if self.vision is not None:
            if len(self.config.image_mean) != self.vision.in_channels:
                raise ConfigError(f"processor config has {len(self.config.image_mean)} "
                                  f"image_mean values; vision_config.in_channels is "
                                  f"{self.vision.in_channels}")
            factor = self.factor
            for name in ("max_pixels", "video_max_pixels"):
                _check(getattr(self.config, name) >= factor * factor, name,
                       f">= (patch_size * spatial_merge_size)^2 = {factor * factor}",
                       getattr(self.config, name))

    @classmethod
    def from_pretrained(cls, directory: str | Path, tokenizer: Any = None) -> MuseSparkProcessor:
        """From a checkpoint folder: its config.json, processor_config.json (or defaults) and,
        when no tokenizer is given and the folder has one, its tokenizer."""
        if tokenizer is None and (Path(directory) / "tokenizer.json").is_file():
            from muse.tokenizer import MuseTokenizer
            tokenizer = MuseTokenizer.from_pretrained(directory)
        return cls(MuseSparkConfig.load(directory), ProcessorConfig.load(directory), tokenizer)

    def save_pretrained(self, directory: str | Path) -> None:
        self.config.save(directory)

    @property
    def factor(self) -> int:
        vision = self._vision_config("image")
        return vision.patch_size * vision.spatial_merge_size

    def _vision_config(self, kind: str) -> VisionConfig:
        if self.vision is None:
            raise ProcessorError(f"this model has no vision encoder, so it takes no {kind}s")
        return self.vision

    # ------------------------------------------------------------------ images and video

    def preprocess_image(self, image: Any) -> torch.Tensor:
        """A PIL image or uint8 [H, W, 3] array / tensor -> normalized float32 [C, H, W]."""
        pixels = _as_uint8_image(image, "image")
        height, width = pixels.shape[:2]
        size = smart_resize(height, width, self.factor, self.config.min_pixels,
                            self.config.max_pixels)
        return self._normalize(self._resize(pixels, size)[None])[0]

    def preprocess_video(self, video: Any) -> tuple[torch.Tensor, list[float]]:
        """Frames -> normalized float32 [T, C, H, W] (T padded to a multiple of
        temporal_patch_size) and each frame group's timestamp in seconds."""
        frames, timestamps = self._video_frames(video)
        temporal = self._vision_config("video").temporal_patch_size
        if len(frames) > self.config.max_video_frames:
            keep = np.linspace(0, len(frames) - 1, self.config.max_video_frames).round()
            keep = keep.astype(np.int64)
            frames, timestamps = frames[keep], timestamps[keep]
        height, width = frames.shape[1:3]
        size = smart_resize(height, width, self.factor, self.config.min_pixels,
                            self.config.video_max_pixels)
        resized = np.stack([self._resize(frame, size) for frame in frames])
        padding = -len(resized) % temporal
        if padding:
            resized = np.concatenate([resized, np.repeat(resized[-1:], padding, axis=0)])
        group_times = [float(timestamps[i]) for i in range(0, len(frames), temporal)]
        return self._normalize(resized), group_times

    def _video_frames(self, video: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(video, Video):
            frames, timestamps = video.frames, video.timestamps
        elif isinstance(video, tuple) and len(video) == 2:
            frames, timestamps = video
        else:
            frames, timestamps = video, None
        if isinstance(frames, torch.Tensor):
            frames = frames.cpu().numpy()
        if not isinstance(frames, np.ndarray):
            raise ProcessorError(f"a video must be a Video, (frames, timestamps) or uint8 frames "
                                 f"[T, H, W, 3]; got {type(video).__name__}")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 \
                or 0 in frames.shape:
            raise ProcessorError(f"video frames must be uint8 [T, H, W, 3] with T, H, W > 0; got "
                                 f"{frames.dtype} {tuple(frames.shape)}")
        if timestamps is None:
            timestamps = np.arange(len(frames), dtype=np.float64) / self.config.video_fps
        timestamps = np.asarray(timestamps, dtype=np.float64)
        if timestamps.shape != (len(frames),):
            raise ProcessorError(f"a video needs one timestamp per frame: {len(frames)} frames, "
                                 f"timestamps of shape {timestamps.shape}")
        return frames, timestamps

    def _resize(self, pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
        """uint8 [H, W, 3] -> uint8 [height, width, 3]."""
        height, width = size
        if pixels.shape[:2] == (height, width):
            return pixels
        image = Image.fromarray(pixels).resize((width, height),
                                               _RESAMPLING[self.config.resample])
        return np.asarray(image)

    def _normalize(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 [N, H, W, C] -> float32 [N, C, H, W], (x / 255 - mean) / std."""
        # In numpy, channels last, then one transposing copy: the same float32 arithmetic
        # as in torch, at a fraction of its per-call cost in data-loader processes.
        mean = np.asarray(self.config.image_mean, dtype=np.float32)
        std = np.asarray(self.config.image_std, dtype=np.float32)
        x = (pixels.astype(np.float32) / np.float32(255.0) - mean) / std
        return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))

    def grid(self, pixels: torch.Tensor) -> PatchGrid:
        """The patch grid `patchify` will give a preprocessed image / video."""
        vision = self._vision_config("image")
        frames = 1 if pixels.dim() == 3 else pixels.shape[0] // vision.temporal_patch_size
        return PatchGrid(frames, pixels.shape[-2] // vision.patch_size,
                         pixels.shape[-1] // vision.patch_size)

    def time_marker_ids(self, seconds: float) -> list[int]:
        if self.tokenizer is None:
            raise ProcessorError("a video's time markers need a tokenizer; pass one to the "
                                 "processor")
        text = self.config.time_marker.format(seconds=seconds)
        encode = getattr(self.tokenizer, "encode_as_text", None) or self.tokenizer.encode
        return list(encode(text))

    # ------------------------------------------------------------------ audio

    def preprocess_audio(self, audio: Any) -> torch.Tensor:
        """A mono float waveform at the audio encoder's rate -> float32 tensor [samples]."""
        if self.audio is None:
            raise ProcessorError("this model has no audio encoder, so it takes no audio")
        rate = self.audio.sample_rate
        if isinstance(audio, Audio):
            if audio.sample_rate != rate:
                raise ProcessorError(f"audio must be at {rate} Hz; got {audio.sample_rate} Hz "
                                     f"(muse.multimodal.media resamples when decoding)")
            audio = audio.waveform
        if isinstance(audio, np.ndarray):
            if not np.issubdtype(audio.dtype, np.floating):
                raise ProcessorError(f"an audio waveform must be floating point; got "
                                     f"{audio.dtype}: scale integer PCM to float first")
            audio = torch.from_numpy(np.ascontiguousarray(audio))
        if not isinstance(audio, torch.Tensor):
            raise ProcessorError(f"audio must be an Audio, or a float waveform array / tensor "
                                 f"[samples] at {rate} Hz; got {type(audio).__name__}")
        if not audio.is_floating_point():
            raise ProcessorError(f"an audio waveform must be floating point; got {audio.dtype}: "
                                 f"scale integer PCM to float first")
        if audio.dim() != 1:
            raise ProcessorError(f"an audio waveform must be mono, shape [samples]; got shape "
                                 f"{tuple(audio.shape)}: mix the channels down first")
        if audio.numel() == 0:
            raise ProcessorError("an audio clip needs at least one sample")
        audio = audio.detach().cpu().float().contiguous()
        if self.config.trim_audio_silence:
            audio = torch.from_numpy(trim_silence(
                audio.numpy(), rate, SERVING_LEADING_MARGIN_SECONDS).copy())
        return audio

    # ------------------------------------------------------------------ placeholders

    def __call__(self, input_ids: Sequence[int], images: Sequence[Any] = (),
                 videos: Sequence[Any] = (), audios: Sequence[Any] = ()) -> ProcessorOutput:
        """Preprocess the media and expand their placeholders in `input_ids`.

        The prompt's k-th image placeholder is images[k], and so on for video and audio.
        """
        media = {"image": list(images), "video": list(videos), "audio": list(audios)}
        ids = list(input_ids)
        placeholders = self._placeholders(ids, media)
        expanded: list[int] = []
        items: list[ProcessedMedia] = []
        seen = {kind: 0 for kind in KINDS}
        previous = 0
        for position, kind in placeholders:
            expanded += ids[previous:position]
            previous = position + 1
            index = seen[kind]
            seen[kind] += 1
            item = self._process(kind, index, media[kind][index])
            token = self.token_ids[kind]
            if kind == "video":
                per_group = item.grid.tokens_per_group(self.vision.spatial_merge_size)
                for seconds in item.timestamps:
                    expanded += self.time_marker_ids(seconds)
                    item.spans.append((len(expanded), per_group))
                    expanded += [token] * per_group
            else:
                count = (item.grid.num_tokens(self.vision.spatial_merge_size)
                         if kind == "image" else num_audio_tokens(item.data.numel(), self.audio))
                item.spans.append((len(expanded), count))
                expanded += [token] * count
            items.append(item)
        expanded += ids[previous:]
        return ProcessorOutput(expanded, items)

    def _placeholders(self, ids: list[int], media: dict[str, list]) -> list[tuple[int, str]]:
        """(position, kind) of every placeholder, checked against the media given."""
        kind_of = {token: kind for kind, token in self.token_ids.items() if token is not None}
        found = [(position, kind_of[token]) for position, token in enumerate(ids)
                 if token in kind_of]
        for position, kind in found:
            start, end = self.delimiters[kind]
            if not (0 < position < len(ids) - 1 and ids[position - 1] == start
                    and ids[position + 1] == end):
                raise ProcessorError(f"the {kind} token at position {position} is not a "
                                     f"placeholder <|{kind}_start|><|{kind}|><|{kind}_end|> "
                                     f"(were these ids already expanded?)")
        for kind in KINDS:
            count = sum(1 for _, k in found if k == kind)
            if count != len(media[kind]):
                if self.token_ids[kind] is None:
                    raise ProcessorError(f"{len(media[kind])} {kind} item(s) given, but the "
                                         f"model has no {kind}_token_id")
                raise ProcessorError(f"the prompt has {count} {kind} placeholder(s) but "
                                     f"{len(media[kind])} {kind} item(s) were given")
        return found

    def _process(self, kind: str, index: int, item: Any) -> ProcessedMedia:
        if kind == "image":
            if isinstance(item, (Video, Audio)):
                raise ProcessorError(f"images[{index}] is a {type(item).__name__}, not an image")
            data = self.preprocess_image(item)
            return ProcessedMedia(kind, index, data, [], content_hash(kind, data),
                                  self.grid(data))
        if kind == "video":
            if isinstance(item, (Image.Image, Audio)):
                raise ProcessorError(f"videos[{index}] is a {type(item).__name__}, not a video")
            data, times = self.preprocess_video(item)
            return ProcessedMedia(kind, index, data, [], content_hash(kind, data),
                                  self.grid(data), times)
        if isinstance(item, (Image.Image, Video)):
            raise ProcessorError(f"audios[{index}] is a {type(item).__name__}, not audio")
        data = self.preprocess_audio(item)
        return ProcessedMedia(kind, index, data, [], content_hash(kind, data))


def _as_uint8_image(image: Any, where: str) -> np.ndarray:
    """uint8 [H, W, 3] RGB from a PIL image (as a decoded file's: `media.to_rgb`) or a uint8
    array / tensor."""
    if isinstance(image, Image.Image):
        return np.asarray(to_rgb(image))
    if isinstance(image, torch.Tensor):
        image = image.cpu().numpy()
    if not isinstance(image, np.ndarray):
        raise ProcessorError(f"an {where} must be a PIL image or a uint8 array [H, W, 3]; got "
                             f"{type(image).__name__}")
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3 or 0 in image.shape:
        raise ProcessorError(f"an {where} array must be uint8 [H, W, 3] with H, W > 0; got "
                             f"{image.dtype} {tuple(image.shape)}")
    return np.ascontiguousarray(image)

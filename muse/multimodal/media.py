"""Media content parts -> decoded media: fetching a URL safely, then decoding it.

A part's URL is a `data:` URL (base64 or percent-encoded), an http(s) URL or, only when the
server names a folder with --allowed-local-media-path, a `file:` URL inside that folder.
Fetching http(s) resolves the host and refuses it when any of its addresses is loopback,
private, link-local, unspecified or otherwise not globally routable, then connects to the
address it checked (so a second DNS answer cannot swap in another one); every redirect is
checked the same way. --allowed-media-domains, as in vLLM, limits fetching to the hosts it
lists; those hosts are trusted, so their addresses are not checked (an internal media server
is reachable only through it).

Decoding: images with Pillow (RGB; the pixel count is read from the header and checked before
the pixels are decoded), video with PyAV (frames sampled at a given rate, uint8 RGB), audio
with soundfile, or with PyAV what libsndfile cannot read (float32 mono at 24 kHz, the audio
encoder's rate). Every problem a request can cause is a `MediaError`, whose message names the
part and the reason. Fetching and decoding block, so `decode_part` runs them in a thread pool,
off the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
import io
import ipaddress
import json
import math
import os
import socket
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urljoin, urlparse

import httpx
import numpy as np
from PIL import Image, ImageOps

from muse.multimodal.resample import resample

AUDIO_SAMPLE_RATE = 24_000  # the audio encoder's rate
DEFAULT_VIDEO_FPS = 2.0
# The most frames a second a request may ask a video to be sampled at (more than any video
# holds: a higher rate keeps every frame, up to the frame limit).
MAX_VIDEO_FPS = 120.0
# A video too short for this many frames at the requested rate is sampled at this many,
# evenly over its length (Qwen2-VL's processor has the same floor): two frames of a one-second
# clip at 2 fps left the shipped model guessing the direction of motion in 6 of 24 clips,
# four frames in none.
MIN_VIDEO_FRAMES = 4
# Formats Pillow may open: the common ones, so that a request cannot reach the decoders of
# rarely used (and rarely hardened) formats.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG includes MPO
IMAGE_PART_TYPES = ("image_url", "input_image")
VIDEO_PART_TYPES = ("video_url",)
AUDIO_PART_TYPES = ("audio_url", "input_audio")
_READ_CHUNK_BYTES = 1 << 16
# Beyond any real recording; bounds the memory one block of a clip's samples takes.
MAX_AUDIO_SAMPLE_RATE = 384_000
MAX_AUDIO_CHANNELS = 64
_AUDIO_BLOCK_FRAMES = 1 << 16


# Media parts one request may hold, per kind (vLLM's --limit-mm-per-prompt): each part may
# cost up to the per-part limits below, so their number is bounded too.
DEFAULT_LIMIT_MM_PER_PROMPT = {"image": 32, "video": 4, "audio": 8}


def video_fps_of(kwargs: Any, name: str = "mm_processor_kwargs") -> float | None:
    """The `fps` of an `mm_processor_kwargs` mapping (vLLM's; `fps` is the one key muse
    takes), None when it has none; anything else raises ValueError naming `name`."""
    if not isinstance(kwargs, dict) or set(kwargs) - {"fps"}:
        raise ValueError(f"{name} takes only {{\"fps\": N}}; got {kwargs!r}")
    fps = kwargs.get("fps")
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) \
            or not 0 < fps <= MAX_VIDEO_FPS:
        raise ValueError(f"{name} fps must be a number in (0, {MAX_VIDEO_FPS:g}]; got {fps!r}")
    return float(fps)


def parse_video_fps(text: str) -> float | None:
    """The `fps` of a --mm-processor-kwargs value, a JSON object such as `{"fps": 1.0}`."""
    try:
        given = json.loads(text)
    except ValueError:
        raise ValueError(f"--mm-processor-kwargs must be a JSON object; got {text!r}") from None
    return video_fps_of(given, "--mm-processor-kwargs")


def parse_mm_limits(text: str) -> dict[str, int]:
    """A --limit-mm-per-prompt value, a JSON object such as `{"image": 4, "video": 1}`; kinds
    it leaves out keep their defaults."""
    try:
        given = json.loads(text)
    except ValueError:
        raise ValueError(f"--limit-mm-per-prompt must be a JSON object; got {text!r}") from None
    if not isinstance(given, dict) or not all(
            kind in DEFAULT_LIMIT_MM_PER_PROMPT and isinstance(count, int)
            and not isinstance(count, bool) and count >= 0 for kind, count in given.items()):
        raise ValueError(f"--limit-mm-per-prompt must map kinds among "
                         f"{sorted(DEFAULT_LIMIT_MM_PER_PROMPT)} to counts >= 0; got {text!r}")
    return {**DEFAULT_LIMIT_MM_PER_PROMPT, **given}


class MediaError(ValueError):
    """A media part that cannot be used; `where` names the part (e.g. `messages[0].content[1]`),
    `reason` says why."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where, self.reason = where, reason


@dataclass(frozen=True)
class MediaLimits:
    """What fetching and decoding one media part may cost. Field names follow the
    `muse serve` flags."""

    max_media_bytes: int = 64 * 2**20  # fetched (or base64-decoded) bytes of one part
    media_fetch_timeout_s: float = 30.0  # one URL, redirects included
    max_media_redirects: int = 5
    max_image_pixels: int = 6000 * 6000
    max_video_frames: int = 32
    max_video_frame_pixels: int = 3840 * 2160
    max_audio_seconds: float = 600.0
    # vLLM's --allowed-media-domains: when set, only these hosts are fetched from (and their
    # addresses are trusted). Exact host names or IP literals, case-insensitive.
    allowed_media_domains: tuple[str, ...] | None = None
    # vLLM's --allowed-local-media-path: file: URLs are served only from inside this folder.
    allowed_local_media_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_media_bytes", "media_fetch_timeout_s", "max_image_pixels",
                     "max_video_frames", "max_video_frame_pixels", "max_audio_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.max_media_redirects < 0:
            raise ValueError(f"max_media_redirects must be at least 0; got "
                             f"{self.max_media_redirects}")
        if self.allowed_media_domains is not None:
            object.__setattr__(self, "allowed_media_domains", tuple(
                _normal_host(host) for host in self.allowed_media_domains))
        if self.allowed_local_media_path is not None and \
                not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path!r} "
                             "is not a directory")


@dataclass
class Video:
    frames: np.ndarray  # [T, H, W, 3] uint8 RGB
    timestamps: np.ndarray  # [T] float64 seconds from the stream's start


@dataclass
class Audio:
    waveform: np.ndarray  # [samples] float32 mono
    sample_rate: int


# ---------------------------------------------------------------- fetching

def fetch(url: str, limits: MediaLimits, where: str = "media") -> bytes:
    """The bytes `url` names: a data:, http(s): or (when allowed) file: URL."""
    if not isinstance(url, str) or not url:
        raise MediaError(where, "the URL must be a non-empty string")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _fetch_data_url(url, limits, where)
    if scheme in ("http", "https"):
        return _fetch_http(url, limits, where)
    if scheme == "file":
        return _fetch_file(url, limits, where)
    raise MediaError(where, f"URL scheme {scheme or '(none)'!r} is not supported; use "
                            "data:, http: or https:")


def decode_base64(text: str, limits: MediaLimits, where: str) -> bytes:
    """Base64 (standard or URL-safe alphabet) to bytes, refused before decoding when the result
    would exceed max_media_bytes."""
    if not isinstance(text, str):
        raise MediaError(where, "base64 data must be a string")
    if len(text) // 4 * 3 > limits.max_media_bytes:
        raise MediaError(where, f"the data is larger than the {limits.max_media_bytes}-byte "
                                "limit (--max-media-bytes)")
    try:
        data = base64.b64decode("".join(text.split()).translate(_URL_SAFE_TO_STANDARD),
                                validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(where, "the data is not valid base64") from None
    return data


_URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")


def _fetch_data_url(url: str, limits: MediaLimits, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise MediaError(where, "a data: URL needs a ',' before its data")
    if header.lower().endswith(";base64"):
        return decode_base64(payload, limits, where)
    if len(payload) > 3 * limits.max_media_bytes:
        raise MediaError(where, f"the data is larger than the {limits.max_media_bytes}-byte "
                                "limit (--max-media-bytes)")
    data = unquote_to_bytes(payload)
    _check_size(len(data), limits, where)
    return data


def _check_size(size: int, limits: MediaLimits, where: str) -> None:
    if size > limits.max_media_bytes:
        raise MediaError(where, f"the media is larger than the {limits.max_media_bytes}-byte "
                                "limit (--max-media-bytes)")


def _fetch_file(url: str, limits: MediaLimits, where: str) -> bytes:
    if limits.allowed_local_media_path is None:
        raise MediaError(where, "file: URLs are refused: the server was started without "
                                "--allowed-local-media-path")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(where, f"a file: URL must name a local path; got host "
                                f"{parsed.netloc!r}")
    root = Path(limits.allowed_local_media_path).resolve()
    try:
        # resolve() follows symlinks, so a link inside the folder that points out of it is
        # refused.
        path = Path(unquote(parsed.path)).resolve()
        if not path.is_relative_to(root):
            raise MediaError(where, "the file is outside --allowed-local-media-path")
        with open(path, "rb") as file:
            _check_size(os.fstat(file.fileno()).st_size, limits, where)
            data = file.read(limits.max_media_bytes + 1)
    except (OSError, ValueError) as error:
        if isinstance(error, MediaError):
            raise
        raise MediaError(where, "the file does not exist or cannot be read") from None
    _check_size(len(data), limits, where)
    return data


def _normal_host(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


def _refusal(address: str) -> str | None:
    """Why `address` may not be fetched from, or None when it is globally routable."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for reason, flag in (("loopback", ip.is_loopback), ("unspecified", ip.is_unspecified),
                         ("link-local", ip.is_link_local), ("private", ip.is_private),
                         ("multicast", ip.is_multicast), ("reserved", ip.is_reserved)):
        if flag:
            return f"a {reason} address"
    return None if ip.is_global else "not a globally routable address"


def _checked_address(host: str, port: int, where: str) -> str:
    """One address of `host` to connect to, after checking all of them."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        raise MediaError(where, f"host {host!r} could not be resolved") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        reason = _refusal(address)
        if reason is not None:
            raise MediaError(where, f"host {host!r} resolves to {address}, {reason}; media is "
                                    "fetched only from public addresses unless the host is "
                                    "listed in --allowed-media-domains")
    if not addresses:
        raise MediaError(where, f"host {host!r} could not be resolved")
    return addresses[0]


def _fetch_http(url: str, limits: MediaLimits, where: str) -> bytes:
    deadline = time.monotonic() + limits.media_fetch_timeout_s
    # trust_env=False: a proxy from the environment would connect on our behalf, unchecked.
    with httpx.Client(trust_env=False, follow_redirects=False) as client:
        for _ in range(limits.max_media_redirects + 1):
            request = _checked_request(client, url, limits, where, deadline)
            try:
                response = client.send(request, stream=True)
            except httpx.TimeoutException:
                raise _timeout(limits, where) from None
            except httpx.HTTPError as error:
                raise MediaError(where, f"fetching {_shown(url)} failed: "
                                        f"{type(error).__name__}") from None
            try:
                if response.is_redirect:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise MediaError(where, f"fetching {_shown(url)} answered HTTP "
                                            f"{response.status_code}")
                return _read_body(response, limits, where, deadline)
            finally:
                response.close()
    raise MediaError(where, f"more than {limits.max_media_redirects} redirects "
                            "(the limit)")


def _checked_request(client: httpx.Client, url: str, limits: MediaLimits, where: str,
                     deadline: float) -> httpx.Request:
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL:
        raise MediaError(where, "the URL is not valid") from None
    if target.scheme not in ("http", "https") or not target.host:
        raise MediaError(where, f"{_shown(url)} is not an http(s) URL with a host")
    # The IDNA (ASCII) form is what DNS and TLS use; either form may be listed.
    host = _normal_host(target.raw_host.decode("ascii"))
    names = {host, _normal_host(target.host)}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _timeout(limits, where)
    timeout = httpx.Timeout(remaining)
    if limits.allowed_media_domains is not None:
        if names.isdisjoint(limits.allowed_media_domains):
            raise MediaError(where, f"host {host!r} is not in --allowed-media-domains")
        return client.build_request("GET", target, timeout=timeout)
    port = target.port or (443 if target.scheme == "https" else 80)
    address = _checked_address(host, port, where)
    # Connect to the address checked; the Host header and TLS (SNI and the certificate's
    # name) still use the host name.
    return client.build_request(
        "GET", target.copy_with(host=address), timeout=timeout,
        headers={"Host": target.netloc.decode("ascii")},
        extensions={"sni_hostname": host})


def _read_body(response: httpx.Response, limits: MediaLimits, where: str,
               deadline: float) -> bytes:
    length = response.headers.get("content-length")
    if length is not None and length.isdigit():
        _check_size(int(length), limits, where)
    chunks, size = [], 0
    try:
        for chunk in response.iter_bytes(_READ_CHUNK_BYTES):
            size += len(chunk)
            _check_size(size, limits, where)
            if time.monotonic() > deadline:
                raise _timeout(limits, where)
            chunks.append(chunk)
    except httpx.TimeoutException:
        raise _timeout(limits, where) from None
    except httpx.HTTPError as error:
        raise MediaError(where, f"reading the media failed: {type(error).__name__}") from None
    return b"".join(chunks)


def _timeout(limits: MediaLimits, where: str) -> MediaError:
    return MediaError(where, f"fetching took longer than {limits.media_fetch_timeout_s} s "
                             "(--media-fetch-timeout)")


def _shown(url: str, limit: int = 120) -> str:
    return url if len(url) <= limit else url[:limit] + "..."


# ---------------------------------------------------------------- decoding

def decode_image(data: bytes, limits: MediaLimits, where: str = "image") -> Image.Image:
    """An RGB image (EXIF orientation applied; transparency over white; first frame of an
    animation)."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (Image.UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError,
            SyntaxError, EOFError):
        raise MediaError(where, "the data is not an image in a supported format "
                                f"({', '.join(IMAGE_FORMATS)})") from None
    width, height = image.size
    if width * height > limits.max_image_pixels:
        raise MediaError(where, f"the image is {width}x{height}, more than the "
                                f"{limits.max_image_pixels}-pixel limit (--max-image-pixels)")
    try:
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except (OSError, ValueError, SyntaxError, EOFError):
        raise MediaError(where, "the image data is truncated or corrupt") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in RGB, 8 bits a channel: transparency composited over white (as
    transformers' `convert_rgb` does), 16-bit greyscale (a 16-bit PNG or TIFF opens as
    `I;16`) scaled to 8 bits, where Pillow's own conversion clips it (every value above 255
    white); every other mode by Pillow's conversion."""
    if image.mode.startswith("I;16"):
        levels = np.asarray(image, dtype=np.uint32)  # native order whatever the file's
        image = Image.fromarray(((levels * 255 + 32767) // 65535).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA") or \
            (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_video(data: bytes, fps: float, max_frames: int, *,
                 max_frame_pixels: int | None = None, where: str = "video"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Frames sampled `fps` times a second, [T, H, W, 3] uint8 RGB, and their timestamps in
    seconds. A video longer than max_frames / fps is sampled evenly over its whole length at
    max_frames frames instead (when its container states the length; else its first
    max_frames samples are kept), and one shorter than MIN_VIDEO_FRAMES / fps at
    MIN_VIDEO_FRAMES frames (as many as it has, if fewer)."""
    import av  # FFmpeg is loaded on the first video, not when the server starts

    if not fps > 0 or max_frames < 1:
        raise ValueError(f"fps and max_frames must be positive; got {fps}, {max_frames}")
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError(where, "the data has no video stream")
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            width, height = stream.codec_context.width, stream.codec_context.height
            if max_frame_pixels is not None and width * height > max_frame_pixels:
                raise MediaError(where, f"the video is {width}x{height}, more than the "
                                        f"{max_frame_pixels}-pixel limit per frame")
            duration = _duration_s(container, stream)
            interval = 1.0 / fps
            fewest = min(MIN_VIDEO_FRAMES, max_frames)
            if duration is not None and duration * fps > max_frames:
                interval = duration / max_frames
            elif duration is not None and 0 < duration * fps < fewest:
                interval = duration / fewest
            frames, timestamps = [], []
            start = next_time = None
            for index, frame in enumerate(container.decode(stream)):
                when = frame.time if frame.time is not None else index / _rate(stream)
                if next_time is not None and when + 1e-6 < next_time:
                    continue
                if max_frame_pixels is not None and \
                        frame.width * frame.height > max_frame_pixels:
                    raise MediaError(where, f"a frame is {frame.width}x{frame.height}, more "
                                            f"than the {max_frame_pixels}-pixel limit")
                frames.append(frame.to_ndarray(format="rgb24"))
                timestamps.append(when)
                # Sample times stay on the grid start + k * interval, skipping the points
                # a gap in the stream passed over.
                start = when if start is None else start
                steps = math.floor((when - start) / interval + 1e-6) + 1
                next_time = start + steps * interval
                if len(frames) == max_frames:
                    break
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError):
        raise MediaError(where, "the data is not a video FFmpeg can decode") from None
    if not frames:
        raise MediaError(where, "the video has no frames")
    if len({frame.shape for frame in frames}) > 1:
        raise MediaError(where, "the video changes its frame size midway")
    return np.stack(frames), np.asarray(timestamps, dtype=np.float64)


def _duration_s(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base: microseconds
    return None


def _rate(stream) -> float:
    rate = stream.average_rate or stream.guessed_rate
    return float(rate) if rate else 25.0


def decode_audio(data: bytes, limits: MediaLimits, where: str = "audio",
                 sample_rate: int = AUDIO_SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """A float32 mono waveform (channels averaged) at `sample_rate` Hz (see
    muse.multimodal.resample), and that rate. soundfile reads WAV, FLAC, OGG and MP3; what it
    cannot read goes to FFmpeg (PyAV): M4A / AAC voice memos, WebM / Opus recordings from a
    browser, the audio track of a video file."""
    import soundfile  # libsndfile is loaded on the first clip, not when the server starts

    try:
        file = soundfile.SoundFile(io.BytesIO(data))
    except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError, TypeError):
        waveform, orig_rate = _decode_audio_with_ffmpeg(data, limits, where)
    else:
        try:
            with file:
                waveform, orig_rate = _decode_audio_with_soundfile(file, limits, where)
        except MediaError:
            raise
        except (soundfile.LibsndfileError, RuntimeError, OSError, ValueError,
                TypeError):
            raise MediaError(where, _NOT_AUDIO) from None
    return resample(waveform, orig_rate, sample_rate), sample_rate


_NOT_AUDIO = "the data is not audio in a supported format (WAV, FLAC, OGG, MP3, M4A, WebM, ...)"


class _MonoSamples:
    """A clip's samples as they are decoded, mixed down block by block: memory follows the
    samples actually decoded, not a header's frame count, which can be an estimate (MP3) or a
    lie; decoding stops once the clip passes the length limit."""

    def __init__(self, rate: int, channels: int, seconds: float | None, limits: MediaLimits,
                 where: str) -> None:
        if not 0 < rate <= MAX_AUDIO_SAMPLE_RATE or not 0 < channels <= MAX_AUDIO_CHANNELS:
            raise MediaError(where, f"the clip has {channels} channels at {rate} Hz; at most "
                                    f"{MAX_AUDIO_CHANNELS} channels at up to "
                                    f"{MAX_AUDIO_SAMPLE_RATE} Hz are accepted")
        self.limits, self.where = limits, where
        if seconds is not None and seconds > limits.max_audio_seconds:
            raise self.too_long(f"{seconds:.1f} s long, more than")
        self.limit = int(limits.max_audio_seconds * rate)
        self.blocks: list[np.ndarray] = []
        self.total = 0

    def too_long(self, how: str) -> MediaError:
        return MediaError(self.where, f"the clip is {how} the {self.limits.max_audio_seconds} "
                                      "s limit (--max-audio-seconds)")

    def add(self, channels_first: np.ndarray) -> None:
        """One block, [channels, samples] float32."""
        self.total += channels_first.shape[1]
        if self.total > self.limit:
            raise self.too_long("longer than")
        self.blocks.append(channels_first.mean(axis=0, dtype=np.float32))

    def waveform(self) -> np.ndarray:
        if self.total == 0:
            raise MediaError(self.where, "the clip has no samples")
        return np.concatenate(self.blocks)


def _decode_audio_with_soundfile(file, limits: MediaLimits, where: str
                                 ) -> tuple[np.ndarray, int]:
    seconds = file.frames / file.samplerate if file.frames > 0 and file.samplerate > 0 \
        else None
    samples = _MonoSamples(file.samplerate, file.channels, seconds, limits, where)
    while True:
        block = file.read(frames=_AUDIO_BLOCK_FRAMES, dtype="float32", always_2d=True)
        if len(block) == 0:
            return samples.waveform(), file.samplerate
        samples.add(block.T)


def _decode_audio_with_ffmpeg(data: bytes, limits: MediaLimits, where: str
                              ) -> tuple[np.ndarray, int]:
    import av  # FFmpeg is loaded on the first such clip, not when the server starts

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.audio:
                raise MediaError(where, "the data has no audio stream" if
                                 container.streams.video else _NOT_AUDIO)
            stream = container.streams.audio[0]
            rate = stream.codec_context.sample_rate or 0
            layout = stream.codec_context.layout
            samples = _MonoSamples(rate, layout.nb_channels if layout else 0,
                                   _duration_s(container, stream), limits, where)
            # Planar float at the stream's own rate and layout, whatever the codec decodes to
            # (a stream may also change its rate midway).
            planar = av.AudioResampler(format="fltp", layout=layout, rate=rate)
            for frame in container.decode(stream):
                for converted in planar.resample(frame):
                    samples.add(converted.to_ndarray())
            for converted in planar.resample(None):
                samples.add(converted.to_ndarray())
    except MediaError:
        raise
    except (av.FFmpegError, OSError, ValueError, UnicodeDecodeError):
        raise MediaError(where, _NOT_AUDIO) from None
    return samples.waveform(), rate


# ---------------------------------------------------------------- content parts

def load_part(part: dict, limits: MediaLimits, where: str = "content part",
              video_fps: float = DEFAULT_VIDEO_FPS) -> Image.Image | Video | Audio:
    """Fetch and decode one media content part (blocking)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "input_audio":
        payload = part.get("input_audio")
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise MediaError(f"{where}.input_audio", "input_audio needs a base64 `data` "
                                                     "string")
        data = decode_base64(payload["data"], limits, f"{where}.input_audio.data")
        return Audio(*decode_audio(data, limits, f"{where}.input_audio"))
    if kind not in IMAGE_PART_TYPES + VIDEO_PART_TYPES + AUDIO_PART_TYPES:
        raise MediaError(f"{where}.type", f"{kind!r} is not a media content part type")
    # Chat Completions: {"image_url": {"url": ...}}; Responses: {"image_url": "..."}.
    field = "image_url" if kind == "input_image" else kind
    payload = part.get(field)
    url = payload.get("url") if isinstance(payload, dict) else payload
    url_where = f"{where}.{field}.url" if isinstance(payload, dict) else f"{where}.{field}"
    data = fetch(url, limits, url_where)
    media_where = f"{where}.{field}"
    if kind in IMAGE_PART_TYPES:
        return decode_image(data, limits, media_where)
    if kind in VIDEO_PART_TYPES:
        return Video(*decode_video(data, video_fps, limits.max_video_frames,
                                   max_frame_pixels=limits.max_video_frame_pixels,
                                   where=media_where))
    return Audio(*decode_audio(data, limits, media_where))


async def decode_part(part: dict, limits: MediaLimits, executor: Executor | None = None,
                      where: str = "content part", video_fps: float = DEFAULT_VIDEO_FPS
                      ) -> Image.Image | Video | Audio:
    """`load_part` in `executor` (None: the loop's default pool), off the event loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, functools.partial(
        load_part, part, limits, where, video_fps))

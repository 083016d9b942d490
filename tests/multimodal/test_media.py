"""Media content parts: fetching (data:, http(s), file:) under the limits, and decoding images,
video and audio. Every fixture is made here: images with Pillow, a WAV with soundfile, short
videos with PyAV, and a local HTTP server on 127.0.0.1."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image
from scipy.signal import resample_poly

# Project dependencies, absent from images that run muse from a copy of the tree (the GPU one).
av = pytest.importorskip("av")
soundfile = pytest.importorskip("soundfile")

from muse.multimodal.media import (  # noqa: E402
    MIN_VIDEO_FRAMES, Audio, MediaError, MediaLimits, Video, decode_audio, decode_image,
    decode_part, decode_video, fetch, load_part)
from muse.multimodal.resample import resample
from muse.server.launch import add_serve_arguments, media_limits_from

LIMITS = MediaLimits()
LOCAL = MediaLimits(allowed_media_domains=("127.0.0.1",))


def png_bytes(width: int = 32, height: int = 24, mode: str = "RGB") -> bytes:
    image = Image.new(mode, (width, height))
    image.putpixel((0, 0), (255, 0, 0) if mode == "RGB" else (255, 0, 0, 0))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes(waveform: np.ndarray, sample_rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, waveform, sample_rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def video_bytes(container_format: str, codec: str, seconds: float, rate: int = 10,
                width: int = 32, height: int = 32) -> bytes:
    """A clip whose frame i is a flat grey of level 8 * i (mod 256): a frame says its index."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(seconds * rate)):
            pixels = np.full((height, width, 3), 8 * i % 256, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def dominant_frequency(waveform: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(waveform * np.hanning(len(waveform))))
    return float(np.fft.rfftfreq(len(waveform), 1 / sample_rate)[spectrum.argmax()])


# ---------------------------------------------------------------- decoding

def test_image_decodes_to_rgb_and_round_trips_through_a_data_url():
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}}
    image = load_part(part, LIMITS)
    assert image.mode == "RGB" and image.size == (32, 24)
    assert image.getpixel((0, 0)) == (255, 0, 0)


def test_transparent_pixels_are_put_over_white():
    image = decode_image(png_bytes(mode="RGBA"), LIMITS)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("file_format", ["PNG", "TIFF"])
def test_16_bit_greyscale_is_scaled_to_8_bits(file_format):
    """A 16-bit greyscale file opens as `I;16`; Pillow's conversion would clip every level
    above 255 to white."""
    levels = np.array([[0, 257, 32768, 65535]], dtype=np.uint16)
    buffer = io.BytesIO()
    Image.fromarray(levels).save(buffer, format=file_format)
    image = decode_image(buffer.getvalue(), LIMITS)
    assert image.mode == "RGB"
    assert np.asarray(image)[0].tolist() == [[0] * 3, [1] * 3, [128] * 3, [255] * 3]


def test_a_pil_image_offline_is_read_as_the_same_image_sent_as_a_file():
    """`LLM.chat` takes PIL images as they are: a transparent or 16-bit one gives the pixels
    the server gives for its PNG."""
    from muse.multimodal.processor import _as_uint8_image

    transparent = Image.new("RGBA", (4, 2), (200, 10, 10, 0))
    transparent.putpixel((1, 0), (0, 0, 255, 128))
    deep = Image.fromarray(np.array([[0, 1000, 40000, 65535]], dtype=np.uint16))
    for image in (transparent, deep):
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        assert np.array_equal(_as_uint8_image(image, "image"),
                              np.asarray(decode_image(buffer.getvalue(), LIMITS)))


def test_image_formats_outside_the_common_ones_are_refused():
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PPM")
    with pytest.raises(MediaError, match="not an image in a supported format"):
        decode_image(buffer.getvalue(), LIMITS)


def test_an_oversize_image_is_refused_before_its_pixels_are_decoded(monkeypatch):
    data = png_bytes(200, 100)

    def never_called(self):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(Image.Image, "load", never_called)
    monkeypatch.setattr("PIL.ImageFile.ImageFile.load", never_called)
    with pytest.raises(MediaError, match=r"200x100.*--max-image-pixels"):
        decode_image(data, MediaLimits(max_image_pixels=200 * 100 - 1))


@pytest.mark.parametrize(("container_format", "codec"), [("mp4", "mpeg4"), ("webm", "vp8")])
def test_video_frames_are_sampled_at_the_requested_rate(container_format, codec):
    frames, timestamps = decode_video(video_bytes(container_format, codec, seconds=2), fps=2,
                                      max_frames=32)
    assert frames.dtype == np.uint8 and frames.shape == (4, 32, 32, 3)
    np.testing.assert_allclose(timestamps, [0.0, 0.5, 1.0, 1.5], atol=1e-3)
    # Frame i of the clip is grey 8 * i: the samples are frames 0, 5, 10 and 15.
    np.testing.assert_allclose(frames.reshape(4, -1).mean(axis=1), [0, 40, 80, 120], atol=6)


def test_a_long_video_is_sampled_evenly_at_max_frames():
    frames, timestamps = decode_video(video_bytes("mp4", "mpeg4", seconds=4), fps=10,
                                      max_frames=4)
    assert len(frames) == 4
    np.testing.assert_allclose(timestamps, [0.0, 1.0, 2.0, 3.0], atol=1e-3)


def test_a_short_video_is_sampled_at_the_fewest_frames():
    # One second at 2 fps would be two frames: four instead, a quarter second apart.
    frames, timestamps = decode_video(video_bytes("mp4", "mpeg4", seconds=1), fps=2,
                                      max_frames=8)
    assert len(frames) == MIN_VIDEO_FRAMES == 4
    np.testing.assert_allclose(timestamps, [0.0, 0.3, 0.5, 0.8], atol=0.051)
    # The floor never passes max_frames, nor the frames the clip has.
    assert len(decode_video(video_bytes("mp4", "mpeg4", seconds=1), fps=2, max_frames=3)[0]) == 3
    assert len(decode_video(video_bytes("mp4", "mpeg4", seconds=0.2), fps=2, max_frames=8)[0]) == 2


def test_video_part_and_frame_pixel_limit():
    url = data_url(video_bytes("mp4", "mpeg4", seconds=1), "video/mp4")
    video = load_part({"type": "video_url", "video_url": {"url": url}}, LIMITS, video_fps=4)
    assert isinstance(video, Video) and video.frames.shape == (4, 32, 32, 3)
    with pytest.raises(MediaError, match="32x32"):
        load_part({"type": "video_url", "video_url": {"url": url}},
                  MediaLimits(max_video_frame_pixels=32 * 32 - 1))


def test_audio_decodes_from_a_wav_and_an_input_audio_part():
    waveform = (0.5 * np.sin(2 * np.pi * 1000 * np.arange(24_000) / 24_000)).astype(np.float32)
    data = wav_bytes(waveform, 24_000)
    decoded, rate = decode_audio(data, LIMITS)
    assert rate == 24_000 and decoded.dtype == np.float32
    np.testing.assert_allclose(decoded, waveform, atol=1e-6)
    part = {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}
    audio = load_part(part, LIMITS)
    assert isinstance(audio, Audio) and audio.sample_rate == 24_000
    np.testing.assert_allclose(audio.waveform, waveform, atol=1e-6)


def test_resampling_16_to_24_khz_keeps_a_sines_frequency():
    seconds, frequency = 1.0, 440.0
    waveform = np.sin(2 * np.pi * frequency * np.arange(16_000) / 16_000).astype(np.float32)
    decoded, rate = decode_audio(wav_bytes(waveform, 16_000), LIMITS)
    assert rate == 24_000 and len(decoded) == int(24_000 * seconds)
    assert abs(dominant_frequency(decoded, rate) - frequency) <= 1.0
    ideal = np.sin(2 * np.pi * frequency * np.arange(len(decoded)) / rate)
    # Away from the ends (where the filter sees the zero padding), the exact 24 kHz sine.
    np.testing.assert_allclose(decoded[200:-200], ideal[200:-200], atol=1e-3)


@pytest.mark.parametrize(("orig_rate", "target_rate"),
                         [(16_000, 24_000), (44_100, 24_000), (48_000, 24_000)])
def test_resampling_agrees_with_scipys_polyphase_resampler(orig_rate, target_rate):
    rng = np.random.default_rng(0)
    # Noise band-limited to 80% of the lower Nyquist frequency, which both filters pass.
    noise = rng.standard_normal(orig_rate)
    spectrum = np.fft.rfft(noise)
    band = 0.8 * min(orig_rate, target_rate) / 2
    spectrum[np.fft.rfftfreq(orig_rate, 1 / orig_rate) > band] = 0
    waveform = np.fft.irfft(spectrum, orig_rate).astype(np.float32)
    ours = resample(waveform, orig_rate, target_rate)
    theirs = resample_poly(waveform, target_rate, orig_rate)
    assert len(ours) == len(theirs)
    inner = slice(400, -400)
    scale = np.abs(theirs).max()
    assert np.abs(ours[inner] - theirs[inner]).max() < 0.01 * scale


def test_stereo_is_mixed_to_mono():
    # Longer than one block the decoder reads at a time: every block is kept.
    left = np.full(100_000, 0.5, dtype=np.float32)
    right = np.full(100_000, -0.1, dtype=np.float32)
    decoded, _ = decode_audio(wav_bytes(np.stack([left, right], axis=1), 24_000), LIMITS)
    assert decoded.shape == (100_000,)
    np.testing.assert_allclose(decoded, 0.2, atol=1e-6)


def test_a_long_clip_is_refused():
    data = wav_bytes(np.zeros(24_000 * 3, dtype=np.float32), 24_000)
    with pytest.raises(MediaError, match="--max-audio-seconds"):
        decode_audio(data, MediaLimits(max_audio_seconds=2.0))


def encoded_audio(container_format: str, codec: str, channels_first: np.ndarray, rate: int,
                  with_video: bool = False) -> bytes:
    """A clip encoded by FFmpeg (through PyAV), optionally beside a short video stream."""
    buffer = io.BytesIO()
    layout = "mono" if len(channels_first) == 1 else "stereo"
    with av.open(buffer, mode="w", format=container_format) as container:
        video = container.add_stream("mpeg4", rate=10) if with_video else None
        audio = container.add_stream(codec, rate=rate)
        audio.layout = layout
        if video is not None:
            video.width, video.height, video.pix_fmt = 32, 32, "yuv420p"
            for _ in range(10):
                frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), "rgb24")
                container.mux(video.encode(frame))
            container.mux(video.encode(None))
        frame = av.AudioFrame.from_ndarray(channels_first.astype(np.float32), format="fltp",
                                           layout=layout)
        frame.sample_rate = rate
        container.mux(audio.encode(frame))
        container.mux(audio.encode(None))
    return buffer.getvalue()


def dominant_frequency_near(waveform: np.ndarray, rate: int, frequency: float) -> bool:
    return abs(dominant_frequency(waveform, rate) - frequency) <= 2.0


@pytest.mark.parametrize(("container_format", "codec", "rate"),
                         [("mp4", "aac", 44_100), ("ipod", "aac", 48_000),
                          ("webm", "libopus", 48_000)],
                         ids=["mp4-aac", "m4a-aac", "webm-opus"])
def test_formats_libsndfile_cannot_read_are_decoded_by_ffmpeg(container_format, codec, rate):
    # An iPhone voice memo (M4A) and a browser's MediaRecorder clip (WebM / Opus): lossy,
    # with the encoder's priming samples, so the check is the tone and about the length.
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate)
    decoded, sample_rate = decode_audio(encoded_audio(container_format, codec, tone[None], rate),
                                        LIMITS)
    assert sample_rate == 24_000 and decoded.dtype == np.float32
    assert 0.85 < len(decoded) / sample_rate < 1.1
    assert dominant_frequency_near(decoded, sample_rate, 440.0)
    assert 0.2 < np.abs(decoded).max() < 0.5  # AAC overshoots the tone's onset


def test_the_audio_track_of_a_video_file_is_its_audio():
    tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(44_100) / 44_100)
    data = encoded_audio("mp4", "aac", np.stack([tone, tone]), 44_100, with_video=True)
    decoded, rate = decode_audio(data, LIMITS)
    assert dominant_frequency_near(decoded, rate, 300.0)
    silent_video = video_bytes("mp4", "mpeg4", seconds=1)
    with pytest.raises(MediaError, match="no audio stream"):
        decode_audio(silent_video, LIMITS)


def test_ffmpeg_clips_are_mixed_to_mono_and_held_to_the_length_limit():
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(44_100) / 44_100)
    stereo = encoded_audio("mp4", "aac", np.stack([tone, -tone]), 44_100)
    decoded, _ = decode_audio(stereo, LIMITS)
    assert np.abs(decoded).max() < 0.01  # the channels cancel
    with pytest.raises(MediaError, match="--max-audio-seconds"):
        decode_audio(stereo, MediaLimits(max_audio_seconds=0.5))


@pytest.mark.parametrize(("kind", "field"), [("image_url", "image_url"),
                                              ("video_url", "video_url"),
                                              ("audio_url", "audio_url")])
def test_undecodable_bytes_are_a_media_error_naming_the_part(kind, field):
    part = {"type": kind, field: {"url": data_url(b"not media at all" * 10, "x/y")}}
    with pytest.raises(MediaError) as caught:
        load_part(part, LIMITS, where="messages[0].content[2]")
    assert caught.value.where == f"messages[0].content[2].{field}"
    assert str(caught.value).startswith(f"messages[0].content[2].{field}: the data is not")


def test_bad_base64_and_oversize_data_urls_are_refused():
    with pytest.raises(MediaError, match="not valid base64"):
        fetch("data:image/png;base64,@@@@", LIMITS)
    with pytest.raises(MediaError, match="--max-media-bytes"):
        fetch(data_url(bytes(2000), "image/png"), MediaLimits(max_media_bytes=1000))
    assert fetch("data:text/plain,a%20b", LIMITS) == b"a b"
    with pytest.raises(MediaError, match="scheme 'ftp'"):
        fetch("ftp://example.com/a.png", LIMITS)


def test_decode_part_runs_in_the_executor():
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(), "image/png")}}
    threads = []

    class RecordingPool(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            threads.append(fn)
            return super().submit(fn, *args, **kwargs)

    with RecordingPool(max_workers=1) as pool:
        image = asyncio.run(decode_part(part, LIMITS, pool))
    assert image.size == (32, 24) and len(threads) == 1


# ---------------------------------------------------------------- http(s) and file:

class MediaHandler(BaseHTTPRequestHandler):
    """/file: a PNG; /redirect/N: N redirects, then /file; /away: a redirect to another
    host name; /big: a body larger than the test limit, with a Content-Length; /stream: the
    same without one; /slow: headers, then a body 2 s later."""

    def do_GET(self):
        port = self.server.server_address[1]
        if self.path == "/file":
            self._send(png_bytes())
        elif self.path.startswith("/redirect/"):
            left = int(self.path.rsplit("/", 1)[1])
            self._redirect(f"/redirect/{left - 1}" if left > 1 else "/file")
        elif self.path == "/away":
            self._redirect(f"http://localhost:{port}/file")
        elif self.path == "/big":
            self._send(bytes(5000))
        elif self.path == "/stream":
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(bytes(100))
        elif self.path == "/slow":
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.end_headers()
            time.sleep(2)
            self.wfile.write(bytes(10))
        else:
            self.send_error(404)

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), MediaHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_loopback_host_is_refused_by_default(server_url):
    with pytest.raises(MediaError, match="127.0.0.1, a loopback address"):
        fetch(f"{server_url}/file", LIMITS, "messages[0].content[0].image_url.url")


def test_a_host_in_allowed_media_domains_is_fetched(server_url):
    assert fetch(f"{server_url}/file", LOCAL) == png_bytes()
    part = {"type": "image_url", "image_url": {"url": f"{server_url}/file"}}
    assert load_part(part, LOCAL).size == (32, 24)


def test_allowed_media_domains_limits_the_hosts(server_url):
    with pytest.raises(MediaError, match="'127.0.0.1' is not in --allowed-media-domains"):
        fetch(f"{server_url}/file", MediaLimits(allowed_media_domains=("images.example",)))


@pytest.mark.parametrize("address", ["10.1.2.3", "192.168.0.1", "169.254.169.254", "0.0.0.0",
                                     "[::1]", "[::ffff:127.0.0.1]", "[fe80::1]"])
def test_private_link_local_and_unspecified_addresses_are_refused(address):
    with pytest.raises(MediaError, match="address; media is fetched only from public"):
        fetch(f"http://{address}/a.png", LIMITS)


def test_redirects_are_followed_up_to_the_limit(server_url):
    assert fetch(f"{server_url}/redirect/2", LOCAL) == png_bytes()
    limited = MediaLimits(allowed_media_domains=("127.0.0.1",), max_media_redirects=1)
    with pytest.raises(MediaError, match="more than 1 redirects"):
        fetch(f"{server_url}/redirect/2", limited)


def test_each_redirect_is_checked_again(server_url):
    with pytest.raises(MediaError, match="'localhost' is not in --allowed-media-domains"):
        fetch(f"{server_url}/away", LOCAL)


@pytest.mark.parametrize("path", ["/big", "/stream"])
def test_a_body_over_the_size_limit_is_refused(server_url, path):
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), max_media_bytes=1000)
    with pytest.raises(MediaError, match="1000-byte limit"):
        fetch(f"{server_url}{path}", limits)
    assert len(fetch(f"{server_url}{path}", LOCAL)) == 5000


def test_a_slow_server_runs_into_the_fetch_timeout(server_url):
    limits = MediaLimits(allowed_media_domains=("127.0.0.1",), media_fetch_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(MediaError, match="--media-fetch-timeout"):
        fetch(f"{server_url}/slow", limits)
    assert time.monotonic() - started < 1.5


def test_an_error_status_is_a_media_error(server_url):
    with pytest.raises(MediaError, match="HTTP 404"):
        fetch(f"{server_url}/missing", LOCAL)


def test_file_urls_only_inside_the_allowed_local_media_path(tmp_path):
    inside, outside = tmp_path / "media", tmp_path / "other"
    inside.mkdir()
    outside.mkdir()
    (inside / "a.png").write_bytes(png_bytes())
    (outside / "b.png").write_bytes(png_bytes())
    (inside / "link.png").symlink_to(outside / "b.png")
    with pytest.raises(MediaError, match="without --allowed-local-media-path"):
        fetch(f"file://{inside}/a.png", LIMITS)
    allowed = MediaLimits(allowed_local_media_path=str(inside))
    assert fetch(f"file://{inside}/a.png", allowed) == png_bytes()
    for url in (f"file://{outside}/b.png", f"file://{inside}/../other/b.png",
                f"file://{inside}/link.png"):
        with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
            fetch(url, allowed)


# ---------------------------------------------------------------- flags

def test_serve_flags_become_media_limits(tmp_path):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser, default_model="m")
    assert media_limits_from(parser.parse_args([])) == MediaLimits()
    args = parser.parse_args([
        "--allowed-media-domains", "Images.Example", "127.0.0.1",
        "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout", "5",
        "--max-media-bytes", "1000", "--max-image-pixels", "100", "--max-video-frames", "8",
        "--max-audio-seconds", "60"])
    assert media_limits_from(args) == MediaLimits(
        allowed_media_domains=("images.example", "127.0.0.1"),
        allowed_local_media_path=str(tmp_path), media_fetch_timeout_s=5.0,
        max_media_bytes=1000, max_image_pixels=100, max_video_frames=8,
        max_audio_seconds=60.0)
    helps = {action.dest: action.help for action in parser._actions}
    for dest in ("allowed_media_domains", "allowed_local_media_path", "media_fetch_timeout",
                 "max_media_bytes", "max_image_pixels", "max_video_frames",
                 "max_audio_seconds"):
        assert "(default: " in helps[dest]
    with pytest.raises(ValueError, match="--allowed-local-media-path"):
        MediaLimits(allowed_local_media_path=str(tmp_path / "missing"))

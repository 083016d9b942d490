"""Media content parts against a live `muse-spark-tiny` server (random vision and audio
encoders) with the official `openai` client: images, audio and video as data: URLs, several
images in one message, an http URL from a local server allowed by --allowed-media-domains,
parts that cannot be used (400 naming the part), addresses that are refused, and the
encoder-output cache in /metrics. Every media file is made here."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from tests.live_server import MODEL, LiveServer, start_server, stop_server
from tests.server.helpers import metric, read_metrics

av = pytest.importorskip("av")
soundfile = pytest.importorskip("soundfile")

MAX_TOKENS = 3
# 56 x 84 pixels: 2 x 3 merged patches, 6 image tokens (the processor keeps the size),
# between <|image_start|> and <|image_end|>.
IMAGE_SIZE = (56, 84)
IMAGE_PROMPT_TOKENS = 6 + 2


def png_bytes(seed: int, size: tuple[int, int] = IMAGE_SIZE) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def wav_bytes(seconds: float = 0.5, sample_rate: int = 16_000) -> bytes:
    times = np.arange(int(seconds * sample_rate)) / sample_rate
    buffer = io.BytesIO()
    soundfile.write(buffer, 0.3 * np.sin(2 * np.pi * 440 * times), sample_rate, format="WAV")
    return buffer.getvalue()


def mp4_bytes(frames: int = 6, rate: int = 4, size: int = 56) -> bytes:
    """A short clip whose frames are flat greys of rising level."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        for i in range(frames):
            pixels = np.full((size, size, 3), 30 * i % 256, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(client: openai.OpenAI, *parts: dict, text: str = "What is this?", **fields):
    fields.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(
        model=MODEL, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "text", "text": text}, *parts]}],
        **fields)


class PNGHandler(BaseHTTPRequestHandler):
    """/image.png: a PNG; anything else: 404."""

    def do_GET(self):
        if self.path != "/image.png":
            self.send_error(404)
            return
        body = png_bytes(7)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_host() -> Iterator[str]:
    """A local http server for the images fetched by URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PNGHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def media_server(server_logs: Path) -> Iterator[LiveServer]:
    """The tiny preset, fetching media from 127.0.0.1 (the test's own http server) only."""
    live = start_server(server_logs, "--max-model-len", "1024",
                        "--allowed-media-domains", "127.0.0.1")
    yield live
    stop_server(live)


@pytest.fixture
def client(media_server: LiveServer) -> Iterator[openai.OpenAI]:
    with media_server.client() as live_client:
        yield live_client


def text_prompt_tokens(client: openai.OpenAI, text: str = "What is this?") -> int:
    return ask(client, text=text).usage.prompt_tokens


def test_an_image_data_url(client):
    reply = ask(client, image_part(data_url(png_bytes(1), "image/png")))
    # The placeholder's one <|image|> became the image's tokens.
    assert reply.usage.prompt_tokens == text_prompt_tokens(client) + IMAGE_PROMPT_TOKENS
    assert reply.usage.completion_tokens == MAX_TOKENS
    assert reply.choices[0].finish_reason == "length"


def test_an_input_audio_part(client):
    audio = {"type": "input_audio",
             "input_audio": {"data": base64.b64encode(wav_bytes()).decode(), "format": "wav"}}
    reply = ask(client, audio)
    assert reply.usage.prompt_tokens > text_prompt_tokens(client)
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_a_video_url(client):
    video = {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(), "video/mp4")}}
    reply = ask(client, video)
    # 1.5 s sampled at 2 fps: 3 frames, padded to 2 frame pairs, each behind a time marker.
    assert reply.usage.prompt_tokens > text_prompt_tokens(client) + 2 * 4
    assert reply.usage.completion_tokens == MAX_TOKENS


def test_a_video_is_sampled_at_the_requested_fps(client):
    """4 s of video: 16 frames at 4 fps (8 frame pairs), 8 at the model's 2 fps (4 pairs), 4
    at 1 fps (2 pairs); a frame pair is 4 tokens and a time marker. (A shorter clip would get
    the 4 frames of the floor, `MIN_VIDEO_FRAMES`, at 1 fps and at 2.)"""
    clip = mp4_bytes(frames=16, rate=4)
    video = {"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}}

    def prompt_tokens(**kwargs) -> int:
        extra = {"mm_processor_kwargs": kwargs} if kwargs else None
        return ask(client, video, extra_body=extra).usage.prompt_tokens

    slow, default, fast = prompt_tokens(fps=1), prompt_tokens(), prompt_tokens(fps=4)
    assert slow < default < fast
    assert prompt_tokens(fps=2) == default
    for kwargs, param in (({"fps": 0}, "mm_processor_kwargs.fps"),
                          ({"fps": 1000}, "mm_processor_kwargs.fps"),
                          ({"frames": 3}, "mm_processor_kwargs.frames")):
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, video, extra_body={"mm_processor_kwargs": kwargs})
        assert error.value.body["param"] == param


def test_several_images_in_one_message(client):
    urls = [data_url(png_bytes(seed), "image/png") for seed in (2, 3, 4)]
    reply = ask(client, *(image_part(url) for url in urls))
    assert reply.usage.prompt_tokens == text_prompt_tokens(client) + 3 * IMAGE_PROMPT_TOKENS


def test_an_image_streams(client):
    stream = ask(client, image_part(data_url(png_bytes(5), "image/png")), stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_an_http_url_from_an_allowed_host(client, media_host):
    reply = ask(client, image_part(f"http://{media_host}/image.png"))
    assert reply.usage.prompt_tokens == text_prompt_tokens(client) + IMAGE_PROMPT_TOKENS


@pytest.mark.parametrize(("part", "reason"), [
    (image_part("data:image/png;base64,bm90IGFuIGltYWdl"), "not an image"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
     "not audio"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
     "not a video"),
    (image_part("data:image/png;base64,%%%"), "not valid base64"),
])
def test_a_part_that_cannot_be_used_is_a_400_naming_it(client, part, reason):
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, image_part(data_url(png_bytes(6), "image/png")), part)
    body = error.value.body
    assert body["param"] == "messages[0].content[2]"
    assert body["message"].startswith("messages[0].content[2].")
    assert reason in body["message"]


def test_media_past_the_context_is_a_400(client):
    # 1000 x 1000 pixels: 1296 image tokens, more than the 1024 of the context.
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, image_part(data_url(png_bytes(8, (1000, 1000)), "image/png")))
    assert error.value.body["param"] == "messages"
    assert "maximum context length is 1024" in error.value.body["message"]


def test_max_tokens_is_checked_against_the_prompt_with_its_media(client):
    image = image_part(data_url(png_bytes(9), "image/png"))
    prompt_tokens = text_prompt_tokens(client) + IMAGE_PROMPT_TOKENS
    room = 1024 - prompt_tokens
    # Room enough after the text alone, not after the image's tokens.
    with pytest.raises(openai.BadRequestError) as error:
        ask(client, image, max_tokens=room + 1)
    assert error.value.body["param"] == "max_tokens"
    assert f"the prompt has {prompt_tokens} with its media expanded" in \
        error.value.body["message"]
    assert ask(client, image, max_tokens=room).usage.prompt_tokens == prompt_tokens


def test_without_max_tokens_a_media_reply_may_fill_the_context(client):
    image = image_part(data_url(png_bytes(10), "image/png"))
    reply = client.chat.completions.create(
        model=MODEL, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}])
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 1024
    assert reply.choices[0].finish_reason == "length"


def test_tokenize_expands_the_media_as_a_chat_request_does(client, media_server):
    import httpx

    image = image_part(data_url(png_bytes(12), "image/png"))  # an image no other test sends
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    reply = client.chat.completions.create(model=MODEL, max_tokens=1, messages=messages)
    tokenized = httpx.post(f"{media_server.base_url}/tokenize",
                           json={"model": MODEL, "messages": messages}).json()
    assert tokenized["count"] == reply.usage.prompt_tokens == len(tokenized["tokens"])
    # A part that cannot be decoded is the same 400 as in a chat request.
    bad = [{"role": "user", "content": [image_part("data:image/png;base64,bm90IGFuIGltYWdl")]}]
    error = httpx.post(f"{media_server.base_url}/tokenize", json={"model": MODEL, "messages": bad})
    assert error.status_code == 400 and error.json()["error"]["param"] == "messages[0].content[0]"


def test_hosts_outside_the_allowed_domains_are_refused(client, media_host):
    port = media_host.rsplit(":", 1)[1]
    for url in (f"http://localhost:{port}/image.png", "http://10.1.2.3/image.png"):
        with pytest.raises(openai.BadRequestError) as error:
            ask(client, image_part(url))
        assert error.value.body["param"] == "messages[0].content[1]"
        assert "not in --allowed-media-domains" in error.value.body["message"]


def test_private_addresses_are_refused_by_default(server: LiveServer, media_host):
    """The shared server has no --allowed-media-domains: loopback and private hosts are
    refused before anything is fetched."""
    with server.client() as default_client:
        for url, reason in ((f"http://{media_host}/image.png", "a loopback address"),
                            ("http://192.168.1.10/image.png", "a private address")):
            with pytest.raises(openai.BadRequestError) as error:
                ask(default_client, image_part(url))
            assert error.value.body["param"] == "messages[0].content[1]"
            assert reason in error.value.body["message"]


def test_a_repeated_image_is_an_encoder_cache_hit(client, media_server):
    url = data_url(png_bytes(11), "image/png")
    before = read_metrics(media_server.base_url)
    ask(client, image_part(url), text="Describe it.")
    middle = read_metrics(media_server.base_url)
    # Other text before it, so that its tokens are not a prefix-cache hit: the encoder is
    # asked for the image again and its cache answers.
    ask(client, image_part(url), text="And now?")
    after = read_metrics(media_server.base_url)

    def change(name: str, start: dict, end: dict) -> float:
        return metric(end, name) - metric(start, name)

    assert change("muse:encoder_cache_misses_total", before, middle) == 1
    assert change("muse:encoder_cache_hits_total", middle, after) == 1
    assert change("muse:encoder_cache_misses_total", middle, after) == 0
    assert metric(after, "muse:encoder_cache_entries") >= 1
    assert metric(after, "muse:encoder_cache_usage_bytes") > 0
    assert metric(after, "muse:encoder_cache_capacity_bytes") > 0

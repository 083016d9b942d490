"""What the front end and the engine core say to each other (msgspec structs)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from muse.engine.errors import InvalidRequestError
from muse.engine.request import TokenLogprobs
from muse.engine.sampling_params import SamplingParams
from muse.engine.structured_output import DEFAULT_MAX_GRAMMAR_BYTES
from muse.multimodal.media import DEFAULT_VIDEO_FPS


# The dtypes decoded media comes in (images and video frames: uint8; audio: float32), so the
# engine never builds an array of an object or other unexpected dtype from a message.
MEDIA_DTYPES = ("uint8", "float32")


class MediaArray(msgspec.Struct):
    """One decoded media item as raw bytes (msgpack `bin`, no per-element encoding):
    an image's uint8 [H, W, 3] pixels, a video's uint8 [T, H, W, 3] frames with their
    timestamps in seconds, or an audio clip's float32 [samples] at `sample_rate`."""

    kind: str  # "image", "video" or "audio"
    data: bytes
    dtype: str
    shape: list[int]
    timestamps: list[float] | None = None
    sample_rate: int = 0

    @classmethod
    def of(cls, item: Any) -> MediaArray:
        """From what `muse.multimodal.media.load_part` returns."""
        from PIL import Image

        from muse.multimodal.media import Audio, Video

        if isinstance(item, Image.Image):
            return cls._array("image", np.asarray(item.convert("RGB")))
        if isinstance(item, Video):
            return cls._array("video", item.frames,
                              timestamps=[float(t) for t in item.timestamps])
        if isinstance(item, Audio):
            return cls._array("audio", item.waveform.astype(np.float32, copy=False),
                              sample_rate=item.sample_rate)
        raise TypeError(f"not a decoded media item: {type(item).__name__}")

    @classmethod
    def _array(cls, kind: str, array: np.ndarray, **extra: Any) -> MediaArray:
        array = np.ascontiguousarray(array)
        return cls(kind, array.tobytes(), str(array.dtype), list(array.shape), **extra)

    def item(self) -> Any:
        """The engine's `multi_modal_data` item: uint8 pixels, a `Video` or an `Audio`."""
        from muse.multimodal.media import Audio, Video

        if self.dtype not in MEDIA_DTYPES or any(n < 0 for n in self.shape) or \
                int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize != len(self.data):
            raise InvalidRequestError(f"a {self.kind} item's {len(self.data)} bytes do not "
                                      f"hold a {self.dtype} array of shape {self.shape}",
                                      param="multi_modal_data")
        array = np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape)
        if self.kind == "video":
            return Video(array, np.asarray(self.timestamps or [], dtype=np.float64))
        if self.kind == "audio":
            # A writable copy: torch refuses to share a read-only buffer without a warning.
            return Audio(array.copy(), self.sample_rate)
        return array


def multi_modal_data(media: list[MediaArray]) -> dict[str, list]:
    """vLLM's `multi_modal_data`: each kind's items in prompt order."""
    data: dict[str, list] = {}
    for piece in media:
        data.setdefault(piece.kind, []).append(piece.item())
    return data


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Decoded media of a chat request, in the order of its placeholders per kind.
    media: list[MediaArray] = []
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_name: str | None = None  # a loaded LoRA adapter (the request's `model`)


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True):
    pass


class LoadLoRA(msgspec.Struct, tag=True):
    """Read a PEFT adapter folder under a name (`load_inplace`: replace a loaded name's
    weights, the next version); answered by `LoRAAdapters` or `RequestFailed`."""

    request_id: str
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRA(msgspec.Struct, tag=True):
    request_id: str
    lora_name: str


class ExpandPrompt(msgspec.Struct, tag=True):
    """A chat prompt whose media placeholders the engine's processor expands (`/tokenize`:
    only the engine knows how many tokens an item takes); answered by `ExpandedPrompt` or
    `RequestFailed`."""

    request_id: str
    prompt_token_ids: list[int]
    media: list[MediaArray]


class ExpandedPrompt(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]


class LoRAAdapters(msgspec.Struct, tag=True):
    """The adapters the engine knows after a change: name -> path."""

    request_id: str
    adapters: dict[str, str]


class SampleDelta(msgspec.Struct, tag=True):
    """New tokens of sample `index` of a request since the last delta."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    lora_version: int | None = None  # the adapter version the request runs with


class RequestFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    param: str | None = None
    status: int = 400


class EngineStats(msgspec.Struct, tag=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Rank 0's encoder-output cache (`EncoderCache.stats()`: metric name -> value); empty
    # for a model without encoders.
    encoder_cache: dict[str, int] = {}
    # Speculative decoding (muse.speculative.metrics), summed since start; empty without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # The prefix cache by tier ("gpu", and "host" / "disk" with `--kv-offload-gb`): prompt
    # tokens served from each since start, and bytes held and allowed now.
    kv_tier_hit_tokens: dict[str, int] = {}
    kv_tier_used_bytes: dict[str, int] = {}
    kv_tier_capacity_bytes: dict[str, int] = {}


class EngineReady(msgspec.Struct, tag=True):
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]
    # The engine's limit on a schema's (or the tools') JSON text, so the front end refuses
    # larger ones before queueing them.
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    # The media kinds the engine's encoders take, so the front end refuses other media
    # parts before fetching them.
    media_kinds: list[str] = []
    # The frames a second a video is sampled at unless a request or the server asks
    # otherwise (the model's processor setting).
    video_fps: float = DEFAULT_VIDEO_FPS
    # A prefill instance's KV address (host, port) for `kv_transfer_params` replies.
    kv_producer: tuple[str, int] | None = None
    # LoRA adapters loaded at start-up (`--lora-modules`): name -> path.
    lora_adapters: dict[str, str] = {}


class EngineDead(msgspec.Struct, tag=True):
    message: str


ToEngine = (AddRequest | AbortRequest | ResetPrefixCache | LoadLoRA | UnloadLoRA | ExpandPrompt
            | Shutdown)
FromEngine = list[SampleDelta | RequestFailed | ExpandedPrompt | EngineStats | EngineReady
                  | EngineDead | LoRAAdapters]

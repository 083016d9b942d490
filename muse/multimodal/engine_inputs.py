"""Media in the engine: the encoders beside the decoder, and their outputs in its inputs.

A request with media carries the processor's expanded ids and its `ProcessedMedia` items
(`muse.multimodal.processor`). A step that computes some of an item's tokens gets a
`MediaSlice` per (item, span) it touches: where in the step's tokens the slice goes and
which rows of the item's encoder output it takes. Chunked prefill may cut a span anywhere,
so a step takes only the rows of the tokens it computes. The worker encodes the step's items
(through the `EncoderCache`, so an item met again is not encoded twice), embeds the step's
token ids as usual and overwrites the media rows with the encoder rows
(`scatter_media`). Such steps always run eagerly: the CUDA graphs take token ids only.

Prefix caching: a block's key covers its token ids, which are the same placeholder ids for
every image of a size, so the content hashes of the items whose spans meet a block join its
key (`block_media_hashes`); two different images never share KV, the same image does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from muse.config import MuseSparkConfig
from muse.multimodal.audio import AudioEncoder
from muse.multimodal.encoder_cache import EncoderCache, encode_with_cache
from muse.multimodal.processor import ProcessedMedia
from muse.multimodal.vision import VisionEncoder

# Bytes of encoder outputs kept for reuse across steps and requests.
DEFAULT_ENCODER_CACHE_BYTES = 256 * 2**20


class MediaEncoders(nn.Module):
    """The vision and audio encoders a model's config asks for (either may be absent)."""

    def __init__(self, config: MuseSparkConfig) -> None:
        super().__init__()
        hidden = config.text_config.hidden_size
        self.vision = VisionEncoder(config.vision_config, hidden) \
            if config.vision_config is not None else None
        self.audio = AudioEncoder(config.audio_config, hidden) \
            if config.audio_config is not None else None

    @torch.inference_mode()
    def encode(self, items: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """Each item's embeddings [tokens, text hidden], in the order given: images and
        videos in one packed vision pass, audio clips in one packed audio pass."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for encoder, kinds in ((self.vision, ("image", "video")), (self.audio, ("audio",))):
            positions = [i for i, item in enumerate(items) if item.kind in kinds]
            if not positions:
                continue
            if encoder is None:
                raise ValueError(f"this model has no encoder for {items[positions[0]].kind}")
            for i, embeddings in zip(positions, encoder([items[i].data for i in positions])):
                out[i] = embeddings
        return out  # type: ignore[return-value]


def build_media_encoders(config: MuseSparkConfig, seed: int, dtype: torch.dtype,
                         device: torch.device | str) -> MediaEncoders | None:
    """Random encoders for a preset, drawn on the CPU from `seed` (the same on every device
    and for every caller with that seed); None when the config has no encoder."""
    if config.vision_config is None and config.audio_config is None:
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoders = MediaEncoders(config)
    return encoders.to(device=device, dtype=dtype).eval()


@dataclass(frozen=True)
class MediaSlice:
    """Rows [source_start, source_start + length) of an item's encoder output go to the
    step's tokens [offset, offset + length)."""

    item: ProcessedMedia
    offset: int
    source_start: int
    length: int


def media_slices(media: Sequence[ProcessedMedia], start: int, end: int,
                 step_offset: int) -> list[MediaSlice]:
    """The slices of a request's media whose tokens fall in [start, end), the positions this
    step computes for it; `step_offset`: where its tokens begin among the step's."""
    slices = []
    for item in media:
        rows = 0  # rows of the item's output before this span (a video has one per group)
        for span_start, span_length in item.spans:
            lo, hi = max(start, span_start), min(end, span_start + span_length)
            if lo < hi:
                slices.append(MediaSlice(item, step_offset + lo - start,
                                         rows + lo - span_start, hi - lo))
            rows += span_length
    return slices


def block_media_hashes(media: Sequence[ProcessedMedia], start: int, end: int
                       ) -> tuple[str, ...]:
    """Content hashes of the items with a span meeting positions [start, end), in order."""
    return tuple(item.content_hash for item in media
                 if any(s < end and start < s + n for s, n in item.spans))


def scatter_media(embeds: torch.Tensor, slices: Sequence[MediaSlice], encoders: MediaEncoders,
                  cache: EncoderCache) -> torch.Tensor:
    """Overwrite the media rows of a step's input embeddings [tokens, hidden] in place with
    their encoder rows; returns `embeds`."""
    items = list({id(s.item): s.item for s in slices}.values())
    outputs = dict(zip((id(item) for item in items),
                       encode_with_cache(cache, items, encoders.encode)))
    for piece in slices:
        rows = outputs[id(piece.item)][piece.source_start:piece.source_start + piece.length]
        embeds[piece.offset:piece.offset + piece.length] = rows.to(embeds.device, embeds.dtype)
    return embeds

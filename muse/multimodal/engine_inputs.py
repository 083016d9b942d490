"""Media in the engine: the encoders beside the decoder, and their outputs in its inputs.

A request with media carries the processor's expanded ids and its `ProcessedMedia` items
(`muse.multimodal.processor`). A step that computes some of an item's tokens gets a
`MediaSlice` per (item, span) it touches: where in the step's tokens the slice goes and
which rows of the item's encoder output it takes. Chunked prefill may cut a span anywhere,
so a step takes only the rows of the tokens it computes. The worker encodes the step's items
(through the `EncoderCache`, so an item met again is not encoded twice), embeds the step's
token ids as usual and overwrites the media rows with the encoder rows
(`scatter_media`). Such steps always run eagerly: the CUDA graphs take token ids only.

The encoders are a preset's, drawn from the engine's seed (`build_media_encoders`), or a
checkpoint's, read from its `vision_tower.*` / `audio_tower.*` tensors (`load_media_encoders`).
They run in the engine's process, or in worker processes of their own
(`muse.multimodal.encoder_workers`); either is an `Encoders`.

Prefix caching: a block's key covers its token ids, which are the same placeholder ids for
every image of a size, so the content hashes of the items whose spans meet a block join its
key (`block_media_hashes`); two different images never share KV, the same image does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from muse.checkpoint.layout import ENCODER_PREFIXES, CheckpointError, format_names
from muse.checkpoint.reader import CheckpointReader
from muse.config import MuseSparkConfig
from muse.multimodal.audio import AudioEncoder
from muse.multimodal.encoder_cache import EncoderCache, encode_with_cache
from muse.multimodal.processor import ProcessedMedia
from muse.multimodal.vision import VisionEncoder

logger = logging.getLogger("muse")


class Encoders(Protocol):
    """What the engine encodes media with: `MediaEncoders` in-process, or an
    `EncoderWorkerPool` (`muse.multimodal.encoder_workers`)."""

    media_kinds: tuple[str, ...]

    def encode(self, items: Sequence[ProcessedMedia]) -> list[torch.Tensor]: ...


class MediaEncoders(nn.Module):
    """The vision and audio encoders a model's config asks for (either may be absent)."""

    def __init__(self, config: MuseSparkConfig) -> None:
        super().__init__()
        hidden = config.text_config.hidden_size
        # Attribute names are the checkpoint's tensor-name prefixes (`vision_tower.*`,
        # `audio_tower.*`), so a checkpoint's encoder tensors load by name.
        self.vision_tower = VisionEncoder(config.vision_config, hidden) \
            if config.vision_config is not None else None
        self.audio_tower = AudioEncoder(config.audio_config, hidden) \
            if config.audio_config is not None else None

    @property
    def media_kinds(self) -> tuple[str, ...]:
        """The media kinds these encoders read."""
        return (("image", "video") if self.vision_tower is not None else ()) \
            + (("audio",) if self.audio_tower is not None else ())

    @torch.inference_mode()
    def encode(self, items: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """Each item's embeddings [tokens, text hidden], in the order given."""
        return encode_by_tower(self.vision_tower, self.audio_tower, items)


def encode_by_tower(vision_tower: nn.Module | None, audio_tower: nn.Module | None,
                    items: Sequence) -> list[torch.Tensor]:
    """Each item's (anything with `kind` and `data`) embeddings, in the order given: images
    and videos in one packed vision pass, audio clips in one packed audio pass."""
    out: list[torch.Tensor | None] = [None] * len(items)
    for tower, kinds in ((vision_tower, ("image", "video")), (audio_tower, ("audio",))):
        positions = [i for i, item in enumerate(items) if item.kind in kinds]
        if not positions:
            continue
        if tower is None:
            raise ValueError(f"this model has no encoder for {items[positions[0]].kind}")
        for i, embeddings in zip(positions, tower([items[i].data for i in positions])):
            out[i] = embeddings
    return out  # type: ignore[return-value]


def build_media_encoders(config: MuseSparkConfig, seed: int, dtype: torch.dtype,
                         device: torch.device | str) -> MediaEncoders | None:
    """Random encoders for a preset, drawn on the CPU from `seed` (the same on every device
    and for every caller with that seed); None when the config has no encoder."""
    if not has_encoders(config):
        return None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        encoders = MediaEncoders(config)
    return encoders.to(device=device, dtype=dtype).eval()


def has_encoders(config: MuseSparkConfig) -> bool:
    return config.vision_config is not None or config.audio_config is not None


@torch.no_grad()
def load_media_encoders(config: MuseSparkConfig, directory: str | Path, dtype: torch.dtype,
                        device: torch.device | str) -> MediaEncoders | None:
    """The encoders of a checkpoint folder whose config has `vision_config` /
    `audio_config`, filled from its `vision_tower.*` / `audio_tower.*` tensors (cast to
    `dtype`, on `device`); None when the config has no encoder.

    Every tensor of a configured encoder must be there with the module's shape (a
    CheckpointError names what is missing or mis-shaped); encoder tensors the config does not
    ask for are ignored with a warning.
    """
    if not has_encoders(config):
        return None
    # Built on the CPU in float32, as a preset's are, so that buffers computed from the
    # config (not stored) come out the same; the parameters are then overwritten. The random
    # init they are drawn with must not move the global generator (unseeded sampling).
    with torch.random.fork_rng(devices=[]):
        encoders = MediaEncoders(config)
    targets = encoders.state_dict()
    where = f"checkpoint {directory}"
    with CheckpointReader(directory) as reader:
        stored = [name for name in reader.names() if name.startswith(ENCODER_PREFIXES)]
        _check_encoder_names(config, targets, stored, where)
        for name, target in targets.items():
            tensor = reader.get(name)
            if tuple(tensor.shape) != tuple(target.shape):
                raise CheckpointError(f"{where}: encoder tensor `{name}` has shape "
                                      f"{tuple(tensor.shape)}; the config's encoder expects "
                                      f"{tuple(target.shape)}")
            target.copy_(tensor)
    return encoders.to(device=device, dtype=dtype).eval()


def _check_encoder_names(config: MuseSparkConfig, targets: dict[str, torch.Tensor],
                         stored: list[str], where: str) -> None:
    """Raise when a configured encoder's tensor is missing or unknown; warn about tensors of
    an encoder the config does not have (the config decides which encoders run)."""
    built = tuple(prefix for prefix, sub in (("vision_tower.", config.vision_config),
                                             ("audio_tower.", config.audio_config))
                  if sub is not None)
    missing = [name for name in targets if name not in set(stored)]
    if missing:
        raise CheckpointError(
            f"{where}: its config.json has "
            f"{' and '.join(p.removesuffix('_tower.') + '_config' for p in built)} but "
            f"{len(missing)} encoder tensor(s) are missing: {format_names(missing)}")
    unknown = [name for name in stored if name.startswith(built) and name not in targets]
    if unknown:
        raise CheckpointError(f"{where}: {len(unknown)} encoder tensor(s) the config's "
                              f"encoders have no place for: {format_names(unknown)}")
    ignored = [name for name in stored if not name.startswith(built)]
    if ignored:
        logger.warning("%s: ignoring %d tensor(s) of an encoder its config.json does not "
                       "name: %s", where, len(ignored), format_names(ignored))


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


def scatter_media(embeds: torch.Tensor, slices: Sequence[MediaSlice], encoders: Encoders,
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

"""Encoders that turn images, video frames and audio into decoder-width embeddings."""

from muse.multimodal.vision import (
    EncodedMedia,
    PackedMedia,
    PatchGrid,
    VisionEncoder,
    encode_each_alone,
    pack_media,
    patch_positions,
    patchify,
    rotary_2d,
)

__all__ = [
    "EncodedMedia",
    "PackedMedia",
    "PatchGrid",
    "VisionEncoder",
    "encode_each_alone",
    "pack_media",
    "patch_positions",
    "patchify",
    "rotary_2d",
]

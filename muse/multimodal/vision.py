"""The NaViT-style vision encoder shared by images and video frames, patches packed.

Each image or video keeps its native resolution (resizing to multiples of
`patch_size * spatial_merge_size` happens before, on the CPU). It is cut into patches of
`temporal_patch_size` frames x `patch_size`^2 pixels; an image is repeated
`temporal_patch_size` times, so it is one frame group, and a video of T frames is T /
`temporal_patch_size` frame groups. The patches of every image and video of a step are
concatenated into one sequence for the layers.

Attention is block-diagonal with one block per frame group: an image attends within itself
and a video frame group within itself, never across groups, as in Qwen2-VL. So a video's
frame groups are encoded exactly as if each were an image, a step's cost grows linearly with
the number of frames, and each group's tokens can follow their own time marker in the prompt.
Positions are 2D rotary embeddings over each patch's (row, column) in its frame: the first
half of the rotary frequencies turns with the row, the second with the column.

Patch order keeps each `spatial_merge_size` x `spatial_merge_size` square of neighbouring
patches contiguous, so the merger reshapes groups of merge^2 rows into one token of
merge^2 * hidden_size features and projects it to the decoder's width: a frame group of h x w
patches yields h * w / merge^2 tokens, in raster order of the merged squares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache, partial

import torch
import torch.nn.functional as F
from torch import nn

from muse.config import VisionConfig
from muse.kernels.varlen_attention import VarlenLayout, varlen_attention
from muse.multimodal.encoder_layer import Attend, EncoderLayer

# Base of the 2D rotary frequencies (Qwen2-VL's vision encoder uses the same).
ROPE_THETA = 10000.0

# (q, k, v) [tokens, heads, head_dim] -> [tokens, heads, head_dim]


@dataclass(frozen=True)
class PatchGrid:
    """An image's or video's size in patches: frame groups x rows x columns."""

    temporal: int
    height: int
    width: int

    @property
    def num_patches(self) -> int:
        return self.temporal * self.height * self.width

    @property
    def patches_per_group(self) -> int:
        return self.height * self.width

    def tokens_per_group(self, spatial_merge_size: int) -> int:
        """Decoder tokens of one frame group (an image has one group)."""
        return self.patches_per_group // spatial_merge_size ** 2

    def num_tokens(self, spatial_merge_size: int) -> int:
        return self.temporal * self.tokens_per_group(spatial_merge_size)


def _as_frames(pixels: torch.Tensor, config: VisionConfig) -> torch.Tensor:
    """An image [C, H, W] (repeated `temporal_patch_size` times) or video frames [T, C, H, W],
    checked -> frames [T, C, H, W]."""
    patch, temporal, merge = config.patch_size, config.temporal_patch_size, \
        config.spatial_merge_size
    if not pixels.is_floating_point():
        raise ValueError(f"pixels must be a floating-point tensor (normalized values); got "
                         f"{pixels.dtype}")
    if pixels.dim() == 3:
        frames = pixels.unsqueeze(0).expand(temporal, *pixels.shape)
    elif pixels.dim() == 4:
        frames = pixels
        if frames.shape[0] == 0 or frames.shape[0] % temporal:
            raise ValueError(f"a video needs a positive multiple of "
                             f"vision_config.temporal_patch_size={temporal} frames; got "
                             f"{frames.shape[0]}")
    else:
        raise ValueError(f"pixels must be an image [C, H, W] or video frames [T, C, H, W]; got "
                         f"shape {tuple(pixels.shape)}")
    _, channels, height, width = frames.shape
    if channels != config.in_channels:
        raise ValueError(f"pixels have {channels} channels; vision_config.in_channels is "
                         f"{config.in_channels}")
    side = patch * merge
    if height == 0 or width == 0 or height % side or width % side:
        raise ValueError(f"image size {height}x{width} is not a positive multiple of "
                         f"vision_config.patch_size * vision_config.spatial_merge_size = "
                         f"{patch} * {merge} = {side} in both height and width; resize first")
    return frames


def _patchify_frames(frames: torch.Tensor, config: VisionConfig
                     ) -> tuple[torch.Tensor, PatchGrid]:
    """Frames [B, T, C, H, W] of B items of one size -> patches [B, N, C * tp * p * p]."""
    patch, temporal, merge = config.patch_size, config.temporal_patch_size, \
        config.spatial_merge_size
    items, num_frames, channels, height, width = frames.shape
    grid = PatchGrid(num_frames // temporal, height // patch, width // patch)
    x = frames.reshape(items, grid.temporal, temporal, channels, grid.height // merge, merge,
                       patch, grid.width // merge, merge, patch)
    # -> item, groups, square row, square column, row in square, column in square,
    #    channel, frame, pixel row, pixel column
    x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return x.reshape(items, grid.num_patches, channels * temporal * patch * patch), grid


def patchify(pixels: torch.Tensor, config: VisionConfig) -> tuple[torch.Tensor, PatchGrid]:
    """An image [C, H, W] or video frames [T, C, H, W] -> patches [N, C * tp * p * p], grid.

    Features of a patch are ordered (channel, frame, row, column); patches are ordered frame
    group, merged square (raster), then the patches inside the square (raster).
    """
    patches, grid = _patchify_frames(_as_frames(pixels, config)[None], config)
    return patches[0], grid


@lru_cache(maxsize=256)
def patch_positions(grid: PatchGrid, spatial_merge_size: int) -> torch.Tensor:
    """(row, column) in patches of each patch, in `patchify`'s order: long [N, 2]. Cached by
    grid (a step's images come in few sizes): callers must not write to it."""
    merge = spatial_merge_size
    rows = torch.arange(grid.height)[:, None].expand(grid.height, grid.width)
    columns = torch.arange(grid.width)[None, :].expand(grid.height, grid.width)

    def merge_order(x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(grid.height // merge, merge, grid.width // merge, merge)
        return x.permute(0, 2, 1, 3).reshape(-1)

    per_group = torch.stack([merge_order(rows), merge_order(columns)], dim=-1)
    return per_group.repeat(grid.temporal, 1)


def rotary_2d(positions: torch.Tensor, head_dim: int,
              theta: float = ROPE_THETA) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, head_dim] float32 for (row, column) positions [N, 2], rotate-half layout.

    head_dim / 4 frequencies per axis: angles are [row * f, column * f], repeated for the two
    halves that rotate-half pairs up."""
    axis_dim = head_dim // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32,
                                            device=positions.device) / axis_dim)
    angles = (positions.float()[:, :, None] * inv_freq).flatten(1)  # [N, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


@dataclass
class PackedMedia:
    """A step's images and videos as one packed sequence of patches."""

    patches: torch.Tensor  # [total patches, C * tp * p * p]
    grids: list[PatchGrid]
    positions: torch.Tensor  # long [total patches, 2]: (row, column)
    cu_seqlens: torch.Tensor  # int32 [frame groups + 1]: one attention block per frame group
    max_seqlen: int


def pack_media(pixels: Sequence[torch.Tensor], config: VisionConfig) -> PackedMedia:
    """Patchify each image / video and concatenate them; frame groups attend separately."""
    if not pixels:
        raise ValueError("pack_media needs at least one image or video")
    # Items of one size are cut into patches together: a step's images come in few sizes.
    frames = [_as_frames(item, config) for item in pixels]
    by_size: dict[tuple[int, ...], list[int]] = {}
    for index, item in enumerate(frames):
        by_size.setdefault(tuple(item.shape), []).append(index)
    cut: dict[int, tuple[torch.Tensor, PatchGrid]] = {}
    for members in by_size.values():
        batch, grid = _patchify_frames(torch.stack([frames[i] for i in members]), config)
        cut.update((index, (item, grid)) for index, item in zip(members, batch.unbind(0)))
    patches = [cut[index][0] for index in range(len(pixels))]
    grids = [cut[index][1] for index in range(len(pixels))]
    group_lengths = [grid.patches_per_group for grid in grids for _ in range(grid.temporal)]
    cu_seqlens = torch.tensor([0] + group_lengths, dtype=torch.int32).cumsum(0,
                                                                             dtype=torch.int32)
    positions = torch.cat([patch_positions(grid, config.spatial_merge_size) for grid in grids])
    return PackedMedia(torch.cat(patches), grids, positions, cu_seqlens, max(group_lengths))


@dataclass
class EncodedMedia:
    """One image's or video's decoder-width embeddings."""

    embeddings: torch.Tensor  # [tokens, text_hidden], frame group by frame group
    grid: PatchGrid
    tokens_per_group: int

    @property
    def groups(self) -> torch.Tensor:
        """[frame groups, tokens per group, text_hidden]: a video's tokens per frame group
        (for a time marker before each); an image is one group."""
        return self.embeddings.view(self.grid.temporal, self.tokens_per_group, -1)


class VisionMerger(nn.Module):
    """Each merge x merge square of patches -> one decoder-width token."""

    def __init__(self, config: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size ** 2
        self.fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.fc2 = nn.Linear(self.merged_size, text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x.reshape(-1, self.merged_size))))


class VisionEncoder(nn.Module):
    """Images [C, H, W] and videos [T, C, H, W] -> embeddings of the decoder's width.

    Parameters are exactly those `muse.info.vision_parameters` counts."""

    def __init__(self, config: VisionConfig, text_hidden_size: int) -> None:
        super().__init__()
        head_dim = config.hidden_size // config.num_attention_heads
        if head_dim % 4:
            raise ValueError(f"vision_config.hidden_size / vision_config.num_attention_heads "
                             f"(the head dim, {head_dim}) must be a multiple of 4 for 2D "
                             f"rotary positions")
        self.config = config
        self.head_dim = head_dim
        patch_features = config.in_channels * config.temporal_patch_size \
            * config.patch_size ** 2
        self.patch_embed = nn.Linear(patch_features, config.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            EncoderLayer(config.hidden_size, config.num_attention_heads,
                         config.intermediate_size, config.layer_norm_eps)
            for _ in range(config.num_hidden_layers))
        self.post_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.merger = VisionMerger(config, text_hidden_size)

    def forward(self, pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per image / video, its embeddings [tokens, text_hidden] (tokens = patches /
        merge^2; a video's are frame group after frame group)."""
        return [media.embeddings for media in self.encode(pixels)]

    def encode(self, pixels: Sequence[torch.Tensor]) -> list[EncodedMedia]:
        """All images and videos of a step in one packed pass."""
        if not pixels:
            return []
        packed = pack_media(pixels, self.config)
        device = self.patch_embed.weight.device
        cu_seqlens = packed.cu_seqlens.to(device)
        attend = partial(varlen_attention, cu_seqlens=cu_seqlens, scale=self.head_dim ** -0.5,
                         max_seqlen=packed.max_seqlen,
                         layout=VarlenLayout(packed.cu_seqlens.tolist()))
        embeddings = self._run(packed.patches.to(device), packed.positions.to(device), attend)
        merge = self.config.spatial_merge_size
        sizes = [grid.num_tokens(merge) for grid in packed.grids]
        return [EncodedMedia(part, grid, grid.tokens_per_group(merge))
                for part, grid in zip(embeddings.split(sizes), packed.grids)]

    def _run(self, patches: torch.Tensor, positions: torch.Tensor,
             attend: Attend) -> torch.Tensor:
        x = self.patch_embed(patches.to(self.patch_embed.weight.dtype))
        rotary = rotary_2d(positions, self.head_dim)
        for layer in self.layers:
            x = layer(x, attend, rotary)
        return self.merger(self.post_norm(x))


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), scale=scale)
    return out.transpose(0, 1)


def encode_each_alone(encoder: VisionEncoder,
                      pixels: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unpacked reference: every frame group of every image / video run through the
    encoder's weights by itself with plain dense attention, outputs concatenated per item.
    Packed encoding must agree with it."""
    config = encoder.config
    device = encoder.patch_embed.weight.device
    attend = partial(_dense_attention, scale=encoder.head_dim ** -0.5)
    outputs = []
    for item in pixels:
        patches, grid = patchify(item, config)
        positions = patch_positions(PatchGrid(1, grid.height, grid.width),
                                    config.spatial_merge_size).to(device)
        groups = patches.to(device).split(grid.patches_per_group)
        outputs.append(torch.cat([encoder._run(group, positions, attend) for group in groups]))
    return outputs

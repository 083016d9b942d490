"""The NaViT vision encoder: patch order, 2D positions, packed encoding against each image
encoded alone, video frame groups, parameter counts and input errors."""

from __future__ import annotations

import pytest
import torch

from muse.config import VisionConfig
from muse.info import vision_parameters
from muse.multimodal import (
    PatchGrid,
    VisionEncoder,
    encode_each_alone,
    pack_media,
    patch_positions,
    patchify,
    rotary_2d,
)
from muse.presets import full_816b, tiny
from muse.rope import apply_rotary

CONFIG = tiny().vision_config
TEXT_HIDDEN = tiny().text.hidden_size
SIDE = CONFIG.patch_size * CONFIG.spatial_merge_size  # 28


def randomized_encoder(seed: int = 0) -> VisionEncoder:
    """Every parameter random (LayerNorms around 1 and 0), so no weight hides a mistake."""
    torch.manual_seed(seed)
    encoder = VisionEncoder(CONFIG, TEXT_HIDDEN)
    with torch.no_grad():
        for name, parameter in encoder.named_parameters():
            parameter.normal_(0.0, 0.1)
            if "norm" in name and name.endswith("weight"):
                parameter.add_(1.0)
    return encoder.eval()


def media(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, SIDE, SIDE, generator=gen),
            torch.randn(3, 2 * SIDE, 3 * SIDE, generator=gen),
            torch.randn(4, 3, 2 * SIDE, 2 * SIDE, generator=gen),  # a 4-frame video
            torch.randn(3, 3 * SIDE, SIDE, generator=gen)]


def test_patches_hold_the_pixels_at_their_positions() -> None:
    patch, temporal = CONFIG.patch_size, CONFIG.temporal_patch_size
    video = torch.randn(4, 3, 2 * SIDE, 3 * SIDE)
    image = torch.randn(3, SIDE, 2 * SIDE)
    for pixels in (video, image):
        patches, grid = patchify(pixels, CONFIG)
        frames = pixels if pixels.dim() == 4 else pixels.expand(temporal, *pixels.shape)
        positions = patch_positions(grid, CONFIG.spatial_merge_size)
        assert patches.shape == (grid.num_patches, 3 * temporal * patch * patch)
        for index, (row, column) in enumerate(positions.tolist()):
            group = index // grid.patches_per_group
            block = frames[group * temporal:(group + 1) * temporal, :,
                           row * patch:(row + 1) * patch, column * patch:(column + 1) * patch]
            expected = block.permute(1, 0, 2, 3).reshape(-1)  # (channel, frame, row, column)
            assert torch.equal(patches[index], expected)
    assert patchify(video, CONFIG)[1] == PatchGrid(2, 4, 6)
    assert patchify(image, CONFIG)[1] == PatchGrid(1, 2, 4)


def test_each_merge_square_is_contiguous_in_raster_order() -> None:
    merge = CONFIG.spatial_merge_size
    grid = PatchGrid(2, 4, 6)
    positions = patch_positions(grid, merge).view(-1, merge * merge, 2)
    squares = positions // merge
    # Every run of merge^2 patches is one square, and it holds each of its patches once.
    assert torch.equal(squares, squares[:, :1].expand_as(squares))
    assert all(len({tuple(p) for p in square.tolist()}) == merge * merge
               for square in positions)
    square_rows, square_columns = squares[:, 0, 0], squares[:, 0, 1]
    raster = (square_rows * (grid.width // merge) + square_columns).view(grid.temporal, -1)
    assert torch.equal(raster, torch.arange(raster.shape[1]).expand_as(raster))


def test_2d_rotary_scores_depend_only_on_relative_position() -> None:
    head_dim = 16
    q, k = torch.randn(1, 1, head_dim), torch.randn(1, 1, head_dim)

    def score(query_at: tuple[int, int], key_at: tuple[int, int]) -> torch.Tensor:
        cos, sin = rotary_2d(torch.tensor([query_at, key_at]), head_dim)
        rotated_q = apply_rotary(q, cos[:1], sin[:1])
        rotated_k = apply_rotary(k, cos[1:], sin[1:])
        return (rotated_q * rotated_k).sum()

    base = score((1, 2), (3, 7))
    torch.testing.assert_close(score((6, 11), (8, 16)), base, atol=1e-5, rtol=1e-5)
    # Moving along either axis alone changes the score: both axes are encoded.
    assert not torch.allclose(score((1, 2), (4, 7)), base, atol=1e-3)
    assert not torch.allclose(score((1, 2), (3, 8)), base, atol=1e-3)


def test_packed_encoding_equals_each_image_alone() -> None:
    encoder = randomized_encoder()
    pixels = media()
    with torch.no_grad():
        packed = encoder(pixels)
        alone = encode_each_alone(encoder, pixels)
    merge2 = CONFIG.spatial_merge_size ** 2
    assert [out.shape for out in packed] == [
        (SIDE * SIDE // CONFIG.patch_size ** 2 // merge2, TEXT_HIDDEN),
        (6, TEXT_HIDDEN), (2 * 4, TEXT_HIDDEN), (3, TEXT_HIDDEN)]
    for got, expected in zip(packed, alone):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Another batch composition gives the same embeddings for the same image.
    with torch.no_grad():
        reordered = encoder([pixels[3], pixels[1]])
    torch.testing.assert_close(reordered[1], packed[1], atol=1e-5, rtol=1e-5)


def test_packing_has_one_attention_block_per_frame_group() -> None:
    packed = pack_media(media(), CONFIG)
    assert packed.grids == [PatchGrid(1, 2, 2), PatchGrid(1, 4, 6), PatchGrid(2, 4, 4),
                            PatchGrid(1, 6, 2)]
    assert packed.cu_seqlens.tolist() == [0, 4, 28, 44, 60, 72]
    assert packed.max_seqlen == 24
    assert packed.patches.shape[0] == packed.positions.shape[0] == 72


def test_video_tokens_per_frame_group() -> None:
    encoder = randomized_encoder()
    video = media()[2]
    with torch.no_grad():
        (encoded,) = encoder.encode([video])
        (first_pair,) = encoder.encode([video[:2]])
        (second_pair,) = encoder.encode([video[2:]])
    assert encoded.tokens_per_group == 4
    assert encoded.groups.shape == (2, 4, TEXT_HIDDEN)
    # Frame groups attend only within themselves: each equals its frame pair encoded alone.
    torch.testing.assert_close(encoded.groups[0], first_pair.embeddings, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(encoded.groups[1], second_pair.embeddings, atol=1e-5, rtol=1e-5)


def test_an_image_is_one_frame_group_of_repeated_frames() -> None:
    encoder = randomized_encoder()
    image = media()[0]
    with torch.no_grad():
        as_image, as_video = encoder([image, torch.stack([image, image])])
    torch.testing.assert_close(as_image, as_video, atol=0, rtol=0)


@pytest.mark.parametrize("config, text_hidden", [
    (tiny().vision_config, tiny().text.hidden_size),
    (full_816b().vision_config, full_816b().text.hidden_size),
])
def test_parameter_count_matches_info(config: VisionConfig, text_hidden: int) -> None:
    with torch.device("meta"):  # the full model's ~2B parameters are never allocated
        encoder = VisionEncoder(config, text_hidden)
    count = sum(parameter.numel() for parameter in encoder.parameters())
    assert count == vision_parameters(config, text_hidden)


@pytest.mark.parametrize("pixels, message", [
    (torch.zeros(3, SIDE + 2, SIDE), "multiple of vision_config.patch_size"),
    (torch.zeros(3, SIDE, CONFIG.patch_size), "multiple of vision_config.patch_size"),
    (torch.zeros(1, SIDE, SIDE), "vision_config.in_channels"),
    (torch.zeros(3, 3, SIDE, SIDE), "vision_config.temporal_patch_size"),
    (torch.zeros(3, SIDE, SIDE, dtype=torch.uint8), "floating-point"),
    (torch.zeros(SIDE, SIDE), r"\[C, H, W\]"),
])
def test_bad_pixels_raise_a_clear_error(pixels: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VisionEncoder(CONFIG, TEXT_HIDDEN)([pixels])


def test_head_dim_must_allow_2d_rotary() -> None:
    config = VisionConfig(hidden_size=12, num_attention_heads=2)  # head dim 6
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionEncoder(config, TEXT_HIDDEN)

"""The packed variable-length attention kernel against its torch twin, and the twin against
dense attention run on each sequence alone."""

from __future__ import annotations

import pytest
import torch

from muse.kernels.varlen_attention import (VarlenLayout, varlen_attention,
                                           varlen_attention_torch)

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def packed(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, device: str,
           seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=gen).to(device=device, dtype=dtype)
               for _ in range(3))
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                              dtype=torch.int32, device=device)
    return q, k, v, cu_seqlens


def test_twin_equals_dense_attention_of_each_sequence_alone() -> None:
    lengths = [5, 1, 12]
    q, k, v, cu_seqlens = packed(lengths, heads=3, head_dim=8, dtype=torch.float32,
                                 device="cpu")
    out = varlen_attention_torch(q, k, v, cu_seqlens, scale=0.3)
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * 0.3
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows])
        torch.testing.assert_close(out[rows], expected, atol=1e-5, rtol=1e-5)
        start += length


def _dense_each_alone(q, k, v, lengths, scale):
    out, start = [], 0
    for length in lengths:
        rows = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[rows]))
        start += length
    return torch.cat(out)


def test_twin_batches_equal_lengths_and_keeps_gradients() -> None:
    # Repeated lengths in any order, an empty sequence: grouping must put rows back in place.
    lengths = [4, 7, 4, 0, 7, 4]
    q, k, v, cu_seqlens = packed(lengths, heads=2, head_dim=8, dtype=torch.float32,
                                 device="cpu", seed=3)
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    references = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention_torch(*inputs, cu_seqlens, scale=0.4)
    expected = _dense_each_alone(*references, lengths, 0.4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for got, want in zip(inputs, references):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_twin_pads_sequences_of_near_lengths_into_one_call() -> None:
    """Lengths within BUCKET_RATIO of each other share a padded, masked SDPA call; the
    padding changes neither the outputs nor the gradients, and a layout kept for the step
    gives what one made from cu_seqlens gives."""
    lengths = [8, 10, 9, 1, 30, 33]
    q, k, v, cu_seqlens = packed(lengths, heads=2, head_dim=8, dtype=torch.float32,
                                 device="cpu", seed=5)
    layout = VarlenLayout(cu_seqlens.tolist())
    assert [[length for length, _ in bucket] for bucket in layout.buckets] == \
        [[1], [8, 9, 10], [30, 33]]
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    references = [x.clone().requires_grad_() for x in (q, k, v)]
    out = varlen_attention_torch(*inputs, cu_seqlens, scale=0.4, layout=layout)
    expected = _dense_each_alone(*references, lengths, 0.4)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(varlen_attention_torch(q, k, v, cu_seqlens, scale=0.4), out)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (expected * weights).sum().backward()
    for got, want in zip(inputs, references):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)


def test_no_attention_across_sequences() -> None:
    q, k, v, cu_seqlens = packed([4, 6], heads=2, head_dim=8, dtype=torch.float32,
                                 device="cpu")
    out = varlen_attention_torch(q, k, v, cu_seqlens, scale=0.35)
    k2, v2 = k.clone(), v.clone()
    k2[4:], v2[4:] = torch.randn_like(k[4:]), torch.randn_like(v[4:])
    out2 = varlen_attention_torch(q, k2, v2, cu_seqlens, scale=0.35)
    torch.testing.assert_close(out2[:4], out[:4], atol=0, rtol=0)


def test_mismatched_shapes_are_rejected() -> None:
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="one shape"):
        varlen_attention(q, q[:3], q, torch.tensor([0, 4]), scale=1.0)


def test_dispatch_uses_the_twin_off_cuda() -> None:
    q, k, v, cu_seqlens = packed([3, 2], heads=2, head_dim=8, dtype=torch.float32,
                                 device="cpu")
    torch.testing.assert_close(varlen_attention(q, k, v, cu_seqlens, 0.5),
                               varlen_attention_torch(q, k, v, cu_seqlens, 0.5))


@pytest.fixture
def triton_kernel():
    return pytest.importorskip("muse.kernels.varlen_attention_triton", reason="needs triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths, heads, head_dim", [
    ([1, 37, 1, 16, 0, 20], 3, 16),  # 1-token and empty sequences, several key tiles
    ([9, 1, 40], 2, 24),  # head_dim padded to the next power of two
])
def test_triton_kernel_matches_twin(lengths, heads, head_dim, dtype, device,
                                    triton_kernel) -> None:
    q, k, v, cu_seqlens = packed(lengths, heads, head_dim, dtype, device, seed=len(lengths))
    scale = head_dim ** -0.5
    # Small tiles so the interpreter walks several query and key tiles per sequence.
    out = triton_kernel.varlen_attention_triton(q, k, v, cu_seqlens, scale, block_m=16,
                                                block_n=16)
    expected = varlen_attention_torch(q.float(), k.float(), v.float(), cu_seqlens, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_triton_kernel_reads_strided_heads(device, triton_kernel) -> None:
    """q, k, v as views into one fused qkv projection, as the encoder produces them."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(30, 3, 2, 16, generator=gen).to(device)
    q, k, v = qkv.unbind(1)
    cu_seqlens = torch.tensor([0, 7, 30], dtype=torch.int32, device=device)
    out = triton_kernel.varlen_attention_triton(q, k, v, cu_seqlens, 0.25, max_seqlen=23,
                                                block_m=16, block_n=16)
    torch.testing.assert_close(out, varlen_attention_torch(q, k, v, cu_seqlens, 0.25),
                               atol=1e-4, rtol=1e-4)


def test_vision_encoder_through_the_kernel(monkeypatch, device, triton_kernel) -> None:
    """The encoder's packed step (views of a fused qkv, images and a video) on the kernel."""
    from muse.multimodal import vision
    from muse.presets import tiny

    torch.manual_seed(0)
    encoder = vision.VisionEncoder(tiny().vision_config, tiny().text.hidden_size).to(device)
    side = 28
    gen = torch.Generator().manual_seed(1)
    pixels = [torch.randn(3, side, 2 * side, generator=gen),
              torch.randn(2, 3, side, side, generator=gen)]
    with torch.no_grad():
        expected = vision.encode_each_alone(encoder, pixels)
        # The kernel reads cu_seqlens itself: the torch path's layout is not for it.
        monkeypatch.setattr(vision, "varlen_attention", lambda *args, layout=None, **kwargs:
                            triton_kernel.varlen_attention_triton(*args, **kwargs))
        got = encoder(pixels)
    for out, reference in zip(got, expected):
        torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)

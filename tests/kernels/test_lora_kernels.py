"""Batched multi-LoRA (BGMV) shrink and expand: the torch twins against a per-row float64 loop,
the Triton kernels against the twins.

Every check mixes rows of different adapter slots with rows without an adapter (-1), which
must come out as u = 0 and an untouched y, bit for bit. Sizes are small: the kernels run under
Triton's interpreter on CPU.
"""

from __future__ import annotations


import pytest
import torch

from muse.kernels.lora import (
    lora_expand,
    lora_expand_torch,
    lora_shrink,
    lora_shrink_torch,
)
from tests.conftest import DEVICE
from tests.kernels.hopper_compile import assert_script_compiles

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# u is float32 in both paths, which differ only in the order of their float32 sums (of terms
# of order one: the inputs are scaled so that u and y are).
U_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
# y is rounded once to its dtype from float32 values that differ by the sums' order: the two
# roundings can land one ulp apart (2^-7 relative for bfloat16, 2^-10 for float16). Triton's
# interpreter also truncates float32 to bfloat16 where the GPU rounds to nearest; that too
# stays within one ulp.
Y_TOLERANCE = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
               torch.float16: {"rtol": 2.0 ** -10, "atol": 1e-4},
               torch.bfloat16: {"rtol": 2.0 ** -7, "atol": 1e-4}}


def random_indices(num_rows: int, num_slots: int, gen: torch.Generator,
                   dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Slots in [-1, num_slots), with a row without an adapter and the last and second slots
    among the first rows, so that every batch of three rows or more mixes them."""
    indices = torch.randint(-1, num_slots, (num_rows,), generator=gen)
    indices[:3] = torch.tensor([-1, num_slots - 1, 1])[:num_rows]
    return indices.to(DEVICE, dtype)


def random_lora(num_slots: int, rank: int, in_features: int, out_features: int,
                dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_a [S, R, K] and lora_b [S, N, R], scaled so that u and the update are of order
    one."""
    lora_a = torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5
    lora_b = torch.randn(num_slots, out_features, rank, generator=gen) / rank ** 0.5
    return lora_a.to(DEVICE, dtype), lora_b.to(DEVICE, dtype)


def loop_shrink(x: torch.Tensor, lora_a: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """float64 [T, R], one row at a time."""
    u = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for row, slot in enumerate(indices.tolist()):
        if slot >= 0:
            u[row] = lora_a[slot].cpu().double() @ x[row].cpu().double()
    return u


def loop_expand(y: torch.Tensor, u: torch.Tensor, lora_b: torch.Tensor, indices: torch.Tensor,
                out_offset: int, rank_offset: int) -> torch.Tensor:
    """float64 copy of y with each adapter row's update added, one row at a time."""
    out = y.cpu().double()
    _, out_features, rank = lora_b.shape
    for row, slot in enumerate(indices.tolist()):
        if slot >= 0:
            part = u[row, rank_offset:rank_offset + rank].cpu().double()
            out[row, out_offset:out_offset + out_features] += lora_b[slot].cpu().double() @ part
    return out


# --- the twins --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_twins_match_per_row_loop(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    num_rows, in_features, out_features, rank, num_slots = 9, 19, 11, 4, 3
    x = torch.randn(num_rows, in_features, generator=gen).to(DEVICE, dtype)
    lora_a, lora_b = random_lora(num_slots, rank, in_features, out_features, dtype, gen)
    indices = random_indices(num_rows, num_slots, gen, index_dtype)
    assert len(set(indices.tolist())) == num_slots + 1  # every slot and -1

    u = lora_shrink_torch(x, lora_a, indices)
    assert u.dtype == torch.float32 and u.shape == (num_rows, rank)
    torch.testing.assert_close(u.cpu().double(), loop_shrink(x, lora_a, indices),
                               rtol=1e-5, atol=1e-6)
    assert torch.equal(u[indices < 0], torch.zeros_like(u[indices < 0]))

    # A wider y (two parts of a fused output) and u (two ranks); this part is the second.
    y = torch.randn(num_rows, 2 * out_features + 3, generator=gen).to(DEVICE, dtype)
    wide_u = torch.randn(num_rows, 2 * rank, generator=gen).to(DEVICE)
    expected = loop_expand(y, wide_u, lora_b, indices, out_features, rank)
    before = y.clone()
    lora_expand_torch(y, wide_u, lora_b, indices, out_offset=out_features, rank_offset=rank)
    # Exact float64 values rounded once to y's dtype: within half an ulp (float32 sums aside).
    half_ulp = 2.0 ** -24 if dtype == torch.float32 else 2.0 ** -8
    torch.testing.assert_close(y.cpu().double(), expected, rtol=half_ulp, atol=1e-6)
    assert torch.equal(y[indices < 0], before[indices < 0])
    assert torch.equal(y[:, :out_features], before[:, :out_features])
    assert torch.equal(y[:, 2 * out_features:], before[:, 2 * out_features:])


def test_empty_batch_and_argument_checks() -> None:
    lora_a = torch.zeros(2, 4, 8, device=DEVICE)
    lora_b = torch.zeros(2, 6, 4, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    assert lora_shrink(torch.zeros(0, 8, device=DEVICE), lora_a, none).shape == (0, 4)
    lora_expand(torch.zeros(0, 6, device=DEVICE), torch.zeros(0, 4, device=DEVICE), lora_b,
                none)
    x = torch.zeros(3, 8, device=DEVICE)
    indices = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"lora_a must be \[S, R, K=8\]"):
        lora_shrink(x, lora_a[:, :, :5], indices)
    with pytest.raises(ValueError, match="lora_a must be"):
        lora_shrink(x, lora_a.to(torch.int8), indices)
    with pytest.raises(ValueError, match="indices must be"):
        lora_shrink(x, lora_a, indices.float())
    y, u = torch.zeros(3, 10, device=DEVICE), torch.zeros(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="out_offset 5"):
        lora_expand(y, u, lora_b, indices, out_offset=5)
    with pytest.raises(ValueError, match="rank_offset 6"):
        lora_expand(y, u, lora_b, indices, rank_offset=6)
    with pytest.raises(ValueError, match="u must be"):
        lora_expand(y, u.half(), lora_b, indices)


# --- the Triton kernels -----------------------------------------------------------------------

KERNEL_CASES = [
    # (rows, K, the fused output's parts N, R per part, slots, strided y and x); the block
    # sizes are those `lora_triton` picks for decode (up to 16 rows) and larger batches.
    (0, 37, (45,), 8, 3, False),
    (1, 4100, (7,), 1, 2, False),  # 2 K steps of 4096
    (5, 100, (45, 13, 13), 5, 4, True),  # q/k/v: 3 x 5 ranks in 8 blocks of 2
    (33, 600, (300,), 16, 4, False),  # 2 K steps of 512, 2 rank blocks, 2 N tiles of 256
    (5, 33, (150,), 64, 3, True),  # 3 N tiles of 64
]


def kernel_inputs(num_rows: int, in_features: int, parts: tuple[int, ...], rank: int,
                  num_slots: int, strided: bool, dtype: torch.dtype, seed: int):
    """x, the parts' A stacked along the rank [S, parts * R, K], each part's B, indices and
    a buffer whose columns 2 .. 2 + sum(parts) are y: row-major, or column-major when
    `strided` (x then a view of every other column)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features * (2 if strided else 1), generator=gen)
    x = x[:, ::2] if strided else x
    lora_a = torch.cat([random_lora(num_slots, rank, in_features, n, dtype, gen)[0]
                        for n in parts], dim=1)
    lora_bs = [random_lora(num_slots, rank, in_features, n, dtype, gen)[1] for n in parts]
    width = sum(parts) + 5
    buffer = torch.randn(width, num_rows, generator=gen).t() if strided else \
        torch.randn(num_rows, width, generator=gen)
    indices = random_indices(num_rows, num_slots, gen,
                             torch.int32 if seed % 2 else torch.int64)
    return x.to(DEVICE, dtype), lora_a, lora_bs, indices, buffer.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("num_rows", "in_features", "parts", "rank", "num_slots", "strided"),
                         KERNEL_CASES)
def test_kernels_match_twins(dtype: torch.dtype, num_rows: int, in_features: int,
                             parts: tuple[int, ...], rank: int, num_slots: int,
                             strided: bool) -> None:
    pytest.importorskip("triton")
    from muse.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    x, lora_a, lora_bs, indices, buffer = kernel_inputs(
        num_rows, in_features, parts, rank, num_slots, strided, dtype, seed=num_rows)
    no_adapter = indices < 0

    u = lora_shrink_triton(x, lora_a, indices)
    twin_u = lora_shrink_torch(x, lora_a, indices)
    assert u.dtype == torch.float32 and u.shape == (num_rows, len(parts) * rank)
    torch.testing.assert_close(u, twin_u, **U_TOLERANCE)
    assert torch.equal(u[no_adapter], torch.zeros_like(u[no_adapter]))

    # Both expand the twin's u, so that only the expand is compared.
    before = buffer.clone()
    kernel_buffer, twin_buffer = buffer, buffer.clone()
    y_columns = slice(2, 2 + sum(parts))
    start = 0
    for part, (out_features, lora_b) in enumerate(zip(parts, lora_bs)):
        for expand, target in ((lora_expand_triton, kernel_buffer), (lora_expand_torch,
                                                                     twin_buffer)):
            expand(target[:, y_columns], twin_u, lora_b, indices, out_offset=start,
                   rank_offset=part * rank)
        start += out_features
    assert kernel_buffer.stride() == before.stride()  # updated in place
    torch.testing.assert_close(kernel_buffer, twin_buffer, **Y_TOLERANCE[dtype])
    assert torch.equal(kernel_buffer[no_adapter], before[no_adapter])
    outside = [column for column in range(buffer.shape[1]) if not 2 <= column < y_columns.stop]
    assert torch.equal(kernel_buffer[:, outside], before[:, outside])
    if num_rows > 1:  # the update reached every part
        assert not torch.equal(kernel_buffer[~no_adapter], before[~no_adapter])


def test_mixed_dtypes() -> None:
    """The fused experts' hook: float32 inputs and outputs with bfloat16 factors (and the
    reverse for the factors of shrink), all read as float32."""
    pytest.importorskip("triton")
    from muse.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    x, lora_a, (lora_b,), indices, buffer = kernel_inputs(7, 50, (30,), 8, 3, False,
                                                          torch.bfloat16, 6)
    x, buffer = x.float() * 1.001, buffer.float()
    expected_u = loop_shrink(x, lora_a, indices)
    for shrink in (lora_shrink_triton, lora_shrink_torch):
        u = shrink(x, lora_a, indices)
        torch.testing.assert_close(u.double().cpu(), expected_u, rtol=1e-5, atol=1e-5)
        assert torch.equal(shrink(x.bfloat16(), lora_a.float(), indices),
                           shrink(x.bfloat16(), lora_a, indices))
    expected_y = loop_expand(buffer, u, lora_b, indices, 2, 0)
    for expand in (lora_expand_triton, lora_expand_torch):
        y = buffer.clone()
        expand(y, u, lora_b, indices, out_offset=2)
        torch.testing.assert_close(y.double().cpu(), expected_y, rtol=1e-5, atol=1e-5)
        assert torch.equal(y[indices < 0], buffer[indices < 0])


def test_each_row_reads_its_own_slot() -> None:
    """The negative control: results that took slot 0 for every adapter row (an ignored
    index) fail the tolerance the kernels pass, on every row of another slot."""
    pytest.importorskip("triton")
    from muse.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    dtype = torch.bfloat16
    x, lora_a, (lora_b,), indices, buffer = kernel_inputs(8, 40, (24,), 8, 3, False, dtype, 1)
    slot_zero = torch.where(indices >= 0, 0, -1).to(indices.dtype)
    other_slot = indices > 0
    assert other_slot.any() and (indices == 0).any() and (indices < 0).any()

    for shrink in (lora_shrink_triton, lora_shrink_torch):
        u = shrink(x, lora_a, indices)
        ignored = lora_shrink_torch(x, lora_a, slot_zero)
        torch.testing.assert_close(u[~other_slot], ignored[~other_slot], **U_TOLERANCE)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(u, ignored, **U_TOLERANCE)
        assert ((u - ignored).abs().amax(dim=1)[other_slot] > 0.1).all()

    u = lora_shrink_torch(x, lora_a, indices)
    ignored = buffer.clone()
    lora_expand_torch(ignored, u, lora_b, slot_zero)
    for expand in (lora_expand_triton, lora_expand_torch):
        y = buffer.clone()
        expand(y, u, lora_b, indices)
        with pytest.raises(AssertionError):
            torch.testing.assert_close(y, ignored, **Y_TOLERANCE[dtype])
        assert ((y - ignored).float().abs().amax(dim=1)[other_slot] > 0.1).all()


def test_dispatchers() -> None:
    """The kernels for CUDA tensors, the twins elsewhere."""
    pytest.importorskip("triton")
    from muse.kernels.lora_triton import lora_expand_triton, lora_shrink_triton

    x, lora_a, (lora_b,), indices, buffer = kernel_inputs(5, 40, (24,), 8, 3, False,
                                                          torch.bfloat16, 2)
    shrink = lora_shrink_triton if DEVICE == "cuda" else lora_shrink_torch
    expand = lora_expand_triton if DEVICE == "cuda" else lora_expand_torch
    u = lora_shrink(x, lora_a, indices)
    assert torch.equal(u, shrink(x, lora_a, indices))
    y, expected = buffer.clone(), buffer.clone()
    lora_expand(y, u, lora_b, indices, out_offset=3)
    expand(expected, u, lora_b, indices, out_offset=3)
    assert torch.equal(y, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays() -> None:
    """A captured shrink + expand follows new activations and new slots at replay."""
    from tests.kernels.graph_capture import capture

    dtype = torch.bfloat16
    x, lora_a, (lora_b,), indices, buffer = kernel_inputs(6, 64, (48,), 16, 4, False, dtype, 3)
    static = {"x": x, "indices": indices, "y": buffer}

    def step() -> torch.Tensor:
        u = lora_shrink(static["x"], lora_a, static["indices"])
        lora_expand(static["y"], u, lora_b, static["indices"])
        return u

    graph, u = capture(step)
    for seed in (4, 5):
        new_x, _, _, new_indices, new_buffer = kernel_inputs(6, 64, (48,), 16, 4, False, dtype,
                                                             seed)
        static["x"].copy_(new_x)
        static["indices"].copy_(new_indices.flip(0))
        static["y"].copy_(new_buffer)
        graph.replay()
        expected_u = lora_shrink_torch(new_x, lora_a, new_indices.flip(0))
        torch.testing.assert_close(u, expected_u, **U_TOLERANCE)
        expected_y = new_buffer.clone()
        lora_expand_torch(expected_y, expected_u, lora_b, new_indices.flip(0))
        torch.testing.assert_close(static["y"], expected_y, **Y_TOLERANCE[dtype])


# --- compiled code --------------------------------------------------------------------------

# Compiles both kernels for sm_90 through Triton's NVIDIA back end and ptxas, which need no GPU
# (the interpreter runs the kernels' Python, not the compiler), at the block sizes the
# launchers pick for a 4096-wide layer at ranks 8 and 64. Unit strides are constants, as
# Triton specialises them at launch; other integers and pointers are taken as 16-aligned.
_COMPILE_FOR_HOPPER = r"""
import triton
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import lora_triton

UNIT = {"stride_xk", "stride_ak", "stride_i", "stride_ur", "stride_yn", "stride_br"}

for rank, indices in ((8, "*i32"), (64, "*i64")):
    pad = triton.next_power_of_2(rank)
    compile_for_hopper(
        lora_triton._lora_shrink_kernel,
        dict(x_ptr="*bf16", a_ptr="*bf16", indices_ptr=indices, u_ptr="*fp32"),
        dict(K=4096, RANK=rank, BLOCK_R=2, BLOCK_K=2048), UNIT)
    compile_for_hopper(
        lora_triton._lora_expand_kernel,
        dict(y_ptr="*bf16", u_ptr="*fp32", b_ptr="*bf16", indices_ptr=indices),
        dict(N=4096, RANK=rank, RANK_PAD=pad, BLOCK_N=min(256, 8192 // pad)), UNIT)
print("compiled")
"""


def test_kernels_compile_for_hopper() -> None:
    assert_script_compiles(_COMPILE_FOR_HOPPER)
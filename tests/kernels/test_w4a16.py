"""W4A16 on FP4 weights (NVFP4, MXFP4): the Triton kernels vs their torch twins vs a decode
written out bit by bit.

Three layers of checks: the twin's dequantization equals an independent one (a float64
bit-level decode, and `tests.quantization.dequantize.nv_dequantize`); the Triton GEMM with the
identity as activations returns the twin's rounded weight bit for bit (every nibble, sign and
scale lands where it should); and random GEMMs and fused-experts calls agree with the twins to
GEMM tolerance. Sizes are small: the kernels run under Triton's interpreter on CPU.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import numpy as np  # noqa: E402
import triton  # noqa: E402

from muse.kernels import moe_triton  # noqa: E402
from muse.kernels.moe import fused_experts_torch  # noqa: E402
from muse.kernels.w4a16 import (  # noqa: E402
    Fp4Weight,
    dense_weight,
    w4a16_linear,
    w4a16_linear_torch,
    w4a16_linear_triton,
)
from muse.kernels.w4a16_triton import (GemvTiles, LinearTiles, choose_tiles,  # noqa: E402
                                        split_for, w4a16_gemv)
from muse.kernels.w4a16_triton import w4a16_linear as linear_kernel  # noqa: E402
from muse.kernels.gemv_triton import split_counters  # noqa: E402
from tests.quantization.dequantize import nv_dequantize  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.kernels.hopper_compile import assert_script_compiles  # noqa: E402
from tests.kernels.graph_capture import capture  # noqa: E402
from tests.kernels.test_moe import _OpLog, _record_launches  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
FORMATS = ("nvfp4", "mxfp4")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True, scope="module")
def round_bfloat16_to_nearest():
    """Triton 3.6's interpreter casts float32 to bfloat16 by truncation; compiled kernels
    round to nearest even, as torch does. Under the interpreter these tests round to nearest
    so that the kernels' bfloat16 weight tiles can be compared with the twin's bit for bit."""
    if not triton.knobs.runtime.interpret:
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            values = torch.from_numpy(np.array(src.data, dtype=np.float32))
            bits = values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits, tl.bfloat16)
        return cast(self, src, dst_type)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builder, "cast_impl", cast_impl)
        yield


def random_weight(fmt: str, out: int, inp: int, *, experts: int | None = None,
                  exponents: int = 8, row_factor: bool | None = None, parts: int = 1,
                  seed: int = 0) -> Fp4Weight:
    """Random bytes (every nibble: zeros, negatives, -0), block scales whose exponents span
    +-`exponents` octaves (with some zero blocks for NVFP4) and, for NVFP4 by default, one
    positive factor per part of the rows (as a fused gate/up or q/k/v has)."""
    gen = torch.Generator().manual_seed(seed)
    lead = () if experts is None else (experts,)
    packed = torch.randint(0, 256, (*lead, out, inp // 2), generator=gen, dtype=torch.uint8)
    if fmt == "nvfp4":
        # E4M3 bytes 0x00-0x7e: +0, subnormals and normals up to 448 (0x7f is NaN).
        center, spread = 7 * 8, min(exponents, 7) * 8
        codes = torch.randint(center - spread, center + spread + 8, (*lead, out, inp // 16),
                              generator=gen).clamp(0, 0x7E)
        codes[torch.rand(codes.shape, generator=gen) < 0.05] = 0
        scales = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    else:
        scales = torch.randint(127 - exponents, 127 + exponents + 1, (*lead, out, inp // 32),
                               generator=gen).to(torch.uint8)
    factor = None
    if row_factor if row_factor is not None else fmt == "nvfp4":
        per_part = torch.exp2(torch.empty(*lead, parts).uniform_(-6, 2, generator=gen))
        factor = per_part.repeat_interleave(out // parts, dim=-1)[..., None]
    return Fp4Weight(fmt, packed.to(DEVICE), scales.to(DEVICE),
                     None if factor is None else factor.to(DEVICE))


def bitwise_dequantize(weight: Fp4Weight) -> torch.Tensor:
    """float32 [..., out, in] decoded from the bits in float64, without tables: nibble
    (s, e1, e0, m) is (-1)^s * (e ? (1 + m/2) 2^(e-1) : m/2), E4M3 (s, e3..e0, m2..m0) is
    (e ? (1 + m/8) 2^(e-7) : m/8 2^-6), E8M0 s is 2^(s-127). The float64 products are exact, so
    the one rounding to float32 is the twin's rounding by its row factor."""
    packed = weight.packed.cpu().to(torch.int64)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    sign = 1.0 - 2.0 * (nibbles >> 3).double()
    exponent, mantissa = ((nibbles >> 1) & 3).double(), (nibbles & 1).double()
    values = sign * torch.where(exponent > 0, (1 + mantissa / 2) * 2.0 ** (exponent - 1),
                                mantissa / 2)
    codes = weight.scale_bytes.cpu().to(torch.int64)
    if weight.format == "nvfp4":
        e, m = ((codes >> 3) & 0xF).double(), (codes & 7).double()
        scale = torch.where(e > 0, (1 + m / 8) * 2.0 ** (e - 7), m / 8 * 2.0 ** -6)
        scale = scale * (1.0 - 2.0 * (codes >> 7).double())
    else:
        scale = 2.0 ** (codes.double() - 127)
    w = values * scale.repeat_interleave(weight.block, dim=-1)
    if weight.row_factor is not None:
        w = w * weight.row_factor.cpu().double()
    return w.to(torch.float32)


def assert_close_columns(actual: torch.Tensor, expected: torch.Tensor,
                         dtype: torch.dtype) -> None:
    """Relative to each output column's largest value: the columns' scales differ by orders of
    magnitude (row factors, block scales)."""
    tol = TOLERANCE[dtype]
    expected, actual = expected.float(), actual.float()
    scale = expected.abs().amax(dim=0, keepdim=True).clamp_min(1e-30)
    torch.testing.assert_close(actual / scale, expected / scale, rtol=0, atol=tol)


# --- the twin's dequantization ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("experts", [None, 3], ids=["dense", "experts"])
def test_dequantize_matches_bitwise_decode(fmt: str, experts: int | None) -> None:
    weight = random_weight(fmt, 12, 64, experts=experts, exponents=40, parts=2)
    expected = bitwise_dequantize(weight)
    assert torch.equal(weight.dequantize().cpu(), expected)
    if fmt == "nvfp4":
        assert torch.equal(nv_dequantize(weight.packed.cpu(), weight.scales.cpu(),
                                         weight.row_factor.cpu()), expected)


def test_dequantize_every_code() -> None:
    """Each of the 256 bytes in both nibble positions, and every finite scale code."""
    e4m3 = torch.arange(0x7F, dtype=torch.uint8)  # 0x7f is NaN
    packed = torch.arange(256, dtype=torch.uint8).repeat(len(e4m3), 1)  # [127, 256]: in = 512
    scales = e4m3[:, None].expand(-1, 512 // 16).contiguous().view(torch.float8_e4m3fn)
    nv = Fp4Weight("nvfp4", packed, scales)
    assert torch.equal(nv.dequantize(), bitwise_dequantize(nv))
    e8m0 = torch.arange(255, dtype=torch.uint8)
    mx = Fp4Weight("mxfp4", packed[:1].expand(255, -1).contiguous(),
                   e8m0[:, None].expand(-1, 512 // 32).contiguous())
    assert torch.equal(mx.dequantize(), bitwise_dequantize(mx))
    nan = Fp4Weight("mxfp4", packed[:1, :16], torch.full((1, 1), 255, dtype=torch.uint8))
    assert nan.dequantize().isnan().all()
    as_e8m0 = Fp4Weight("mxfp4", mx.packed, mx.scales.view(torch.float8_e8m0fnu))
    assert torch.equal(as_e8m0.dequantize(), mx.dequantize())


# --- the dense GEMM ---------------------------------------------------------------------------


def one_hot_weight(fmt: str, byte: int) -> Fp4Weight:
    """One output row whose inputs 2 and 3 are the byte's two nibbles (scale 1), all else 0."""
    inp = 32
    packed = torch.zeros(1, inp // 2, dtype=torch.uint8)
    packed[0, 1] = byte
    if fmt == "nvfp4":
        scales = torch.ones(1, inp // 16).to(torch.float8_e4m3fn)
    else:
        scales = torch.full((1, inp // 32), 127, dtype=torch.uint8)
    return Fp4Weight(fmt, packed.to(DEVICE), scales.to(DEVICE))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("linear", [w4a16_linear_torch, w4a16_linear_triton],
                         ids=["torch", "triton"])
def test_nibble_order_and_sign(fmt: str, linear) -> None:
    """0x9 is -0.5 and 0x2 is 1.0; byte 0x29 puts -0.5 on input 2 (low nibble), 1.0 on 3."""
    x = torch.zeros(2, 32, device=DEVICE)
    x[0, 2] = x[1, 3] = 1.0
    for byte, expected in ((0x29, [-0.5, 1.0]), (0x92, [1.0, -0.5]), (0x7F, [-6.0, 6.0]),
                           (0xE1, [0.5, -4.0])):
        y = linear(x, one_hot_weight(fmt, byte))
        assert y[:, 0].tolist() == expected, hex(byte)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_kernel_weight_tiles_are_the_twins(fmt: str, dtype: torch.dtype) -> None:
    """x = I: every output is one weight times 1, so the kernel must return the twin's weight
    rounded to the activation dtype exactly, over scales of many octaves."""
    # float16 covers 2^-24..65504: the weights stay inside it.
    exponents = 6 if dtype == torch.float16 else 60
    weight = random_weight(fmt, 37, 64, exponents=exponents, seed=3)
    expected = weight.dequantize().to(dtype).t()
    eye = torch.eye(64, dtype=dtype, device=DEVICE)
    assert torch.equal(w4a16_linear_triton(eye, weight), expected)
    # Two K steps and an odd number of N tiles.
    tiles = LinearTiles(32, 16, 32, 4, 2)
    assert torch.equal(linear_kernel(eye, weight, tiles=tiles), expected)


LINEAR_CASES = [
    # (M, N, K, tiles): K a multiple of the scale block but not of BLOCK_K, odd N
    (1, 23, 96, LinearTiles(16, 16, 64, 4, 2)),
    (3, 37, 160, LinearTiles(16, 32, 64, 4, 2)),
    # Split-K: three K slices of one 32-wide step each, the last past K's end in part.
    (5, 23, 96, LinearTiles(16, 16, 32, 1, 2, split_k=3)),
    (2, 19, 160, LinearTiles(16, 16, 64, 1, 2, split_k=3)),
    (17, 19, 96, None),
    (65, 21, 64, None),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("num_rows", "out", "inp", "tiles"), LINEAR_CASES)
def test_linear_matches_twin(fmt: str, dtype: torch.dtype, num_rows: int, out: int, inp: int,
                             tiles: LinearTiles | None) -> None:
    weight = random_weight(fmt, out, inp, seed=num_rows)
    gen = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, inp, generator=gen).to(DEVICE, dtype)
    twin = w4a16_linear_torch(x, weight)
    kernel = linear_kernel(x, weight, tiles=tiles)
    assert kernel.dtype == twin.dtype == dtype and kernel.shape == (num_rows, out)
    assert_close_columns(kernel, twin, dtype)
    # The twin is the dequantized model: x @ dequantized(w).T in x's dtype.
    dense = bitwise_dequantize(weight).to(DEVICE, dtype)
    assert torch.equal(twin, F.linear(x, dense))


GEMV_CASES = [
    # (N, K, tiles): K a multiple of the scale block but not of BLOCK_K, odd N; split-K
    (23, 96, GemvTiles(16, 64, 4)),
    (37, 160, GemvTiles(32, 32, 2, split_k=5)),
    (19, 96, None),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("out", "inp", "tiles"), GEMV_CASES)
def test_gemv_matches_twin(fmt: str, dtype: torch.dtype, out: int, inp: int,
                           tiles: GemvTiles | None) -> None:
    """One row (batch-1 decode): the GEMV without tl.dot, bias included."""
    weight = random_weight(fmt, out, inp, seed=out)
    gen = torch.Generator().manual_seed(out)
    x = torch.randn(1, inp, generator=gen).to(DEVICE, dtype)
    bias = torch.randn(out, generator=gen).to(DEVICE, dtype)
    twin = w4a16_linear_torch(x, weight, bias)
    kernel = w4a16_gemv(x[0], weight, bias, tiles=tiles)[None]
    assert kernel.dtype == dtype and kernel.shape == (1, out)
    # Relative to the sum of the terms' sizes: one output has no column of rows to scale by,
    # and a sum that cancels magnifies the twin's per-weight rounding.
    dense = bitwise_dequantize(weight).to(DEVICE)
    size = (x.float().abs() @ dense.abs().t()) + bias.float().abs()
    assert ((kernel.float() - twin.float()).abs() <= TOLERANCE[dtype] * size).all()
    if tiles is None:  # what the linear layer runs for one row
        assert torch.equal(w4a16_linear_triton(x, weight, bias), kernel)


def test_split_gemv_leaves_its_counters_at_zero_and_repeats_exactly() -> None:
    """The last program of each tile adds the partials in split order and resets its counter:
    the next call (the next step, or a graph replay) finds them at zero and sums alike."""
    weight = random_weight("nvfp4", 70, 256, seed=3)
    x = torch.randn(256, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    tiles = GemvTiles(16, 32, 2, split_k=8)
    first = w4a16_gemv(x, weight, tiles=tiles)
    counters = split_counters(first.device, 5)
    assert not counters.any()
    assert torch.equal(w4a16_gemv(x, weight, tiles=tiles), first)
    whole = w4a16_gemv(x, weight, tiles=GemvTiles(16, 32, 2, split_k=1))
    torch.testing.assert_close(first, whole, rtol=2**-7, atol=0)


def test_gemv_reads_every_code_and_scale() -> None:
    """x = one-hot rows: each output is one weight, the twin's up to its rounding to bf16."""
    for fmt in FORMATS:
        weight = random_weight(fmt, 21, 64, exponents=20, seed=5)
        dense = weight.dequantize()
        for k in (0, 1, 17, 63):
            x = torch.zeros(64, dtype=torch.float32, device=DEVICE)
            x[k] = 1.0
            torch.testing.assert_close(w4a16_gemv(x, weight), dense[:, k].to(DEVICE),
                                       rtol=2**-20, atol=0)


def test_linear_bias_leading_dims_and_strides() -> None:
    weight = random_weight("nvfp4", 24, 64, parts=3, seed=7)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 3, 128, generator=gen).to(DEVICE, torch.bfloat16)[..., ::2]
    bias = torch.randn(24, generator=gen).to(DEVICE, torch.bfloat16)
    twin = w4a16_linear_torch(x, weight, bias)
    kernel = w4a16_linear_triton(x, weight, bias)
    assert kernel.shape == (2, 3, 24)
    assert_close_columns(kernel.reshape(6, 24), twin.reshape(6, 24), torch.bfloat16)
    assert w4a16_linear_triton(x[:0], weight).shape == (0, 3, 24)
    # The dispatcher runs the kernel for CUDA tensors and the twin elsewhere.
    assert torch.equal(w4a16_linear(x, weight, bias),
                       kernel if DEVICE == "cuda" else twin)


def test_choose_tiles() -> None:
    for rows in (1, 3, 17, 64, 65, 4096):
        for out, inp in ((5120, 2048), (2048, 4096), (1024, 2048), (24, 32)):
            for dtype in DTYPES.values():
                tiles = choose_tiles(rows, out, inp, dtype)
                assert tiles.block_k % 32 == 0 and tiles.block_k >= 32
                assert tiles.block_m >= min(rows, 16) and tiles.block_n >= 16
    # Decode: 16 x 128 tiles of one warp; N = 5120 gives 320 programs (enough), N = 2048 only
    # 128, split 8 ways along K's 32 steps.
    assert choose_tiles(1, 5120, 2048) == LinearTiles(16, 16, 128, 1, 4, split_k=1)
    assert choose_tiles(1, 2048, 4096) == LinearTiles(16, 16, 128, 1, 4, split_k=8)
    assert choose_tiles(4096, 5120, 2048).split_k == 1  # enough output tiles
    assert split_for(100, 3) == 3 and split_for(300, 16) == 1 and split_for(10, 5) == 5
    with pytest.raises(ValueError, match="split_k"):
        linear_kernel(torch.zeros(1, 96, device=DEVICE), random_weight("nvfp4", 16, 96),
                      tiles=LinearTiles(16, 16, 32, 1, 2, split_k=4))


def test_fp4_weight_checks() -> None:
    packed = torch.zeros(4, 16, dtype=torch.uint8)
    e4m3 = torch.ones(4, 2).to(torch.float8_e4m3fn)
    weight = Fp4Weight("nvfp4", packed, e4m3, torch.ones(4, 1))
    assert weight.shape == (4, 32) and weight.block == 16 and not weight.scale_is_e8m0
    with pytest.raises(ValueError, match="format"):
        Fp4Weight("fp4", packed, e4m3)
    with pytest.raises(ValueError, match="scales of mxfp4"):
        Fp4Weight("mxfp4", packed, e4m3)
    with pytest.raises(ValueError, match=r"in/16\] = \[4, 2\]"):
        Fp4Weight("nvfp4", packed, e4m3[:, :1])
    with pytest.raises(ValueError, match="multiple of 32"):
        Fp4Weight("mxfp4", torch.zeros(4, 8, dtype=torch.uint8),
                  torch.zeros(4, 0, dtype=torch.uint8))
    with pytest.raises(ValueError, match="row_factor"):
        Fp4Weight("nvfp4", packed, e4m3, torch.ones(4))
    with pytest.raises(ValueError, match="packed"):
        Fp4Weight("nvfp4", packed.float(), e4m3)
    with pytest.raises(ValueError, match="input features"):
        w4a16_linear_triton(torch.zeros(1, 16, device=DEVICE),
                            Fp4Weight("nvfp4", packed.to(DEVICE), e4m3.to(DEVICE)))


# --- fused experts ---------------------------------------------------------------------------


def make_experts(fmt: str, num_experts: int, latent: int, inter: int, dtype: torch.dtype,
                 seed: int) -> tuple[Fp4Weight, Fp4Weight, torch.Tensor]:
    """gate_up (gate and up rows each with their own factor, NVFP4), down, expert norms."""
    gate_up = random_weight(fmt, 2 * inter, latent, experts=num_experts, exponents=3,
                            parts=2, seed=seed)
    down = random_weight(fmt, latent, inter, experts=num_experts, exponents=3, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    norm = (1 + 0.2 * torch.randn(num_experts, latent, generator=gen)).to(DEVICE, dtype)
    return gate_up, down, norm


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int,
            chosen: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids without repeats within a token (as `route` gives) and float32 weights that
    sum to one; with `chosen`, every token's first slots are those experts (repeats across
    tokens)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if chosen is not None:
        logits[:, chosen] += 100.0
    ids = logits.topk(top_k).indices
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.5
    return (weights / weights.sum(-1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def activations(num_tokens: int, latent: int, dtype: torch.dtype, seed: int,
                gate_up: Fp4Weight) -> torch.Tensor:
    """Tokens scaled so that every expert's output is of order one (the weights' scales vary
    by a few octaves around 1)."""
    gen = torch.Generator().manual_seed(seed)
    scale = gate_up.dequantize().abs().mean().item() * latent ** 0.5
    return (torch.randn(num_tokens, latent, generator=gen) / scale).to(DEVICE, dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    scale = expected.float().abs().max().item()
    assert scale > 0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


MOE_CASES = [
    # (tokens, experts, top_k, chosen): decode sizes with experts repeated across tokens
    (1, 8, 4, None),
    (3, 8, 2, [1, 6]),
    (5, 8, 2, [0, 3]),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("dtype", "norm"), [(torch.bfloat16, True), (torch.float32, False)],
                         ids=["bf16-norm", "fp32-no_norm"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "chosen"), MOE_CASES)
def test_fused_experts_match_twin(fmt: str, dtype: torch.dtype, norm: bool, num_tokens: int,
                                  num_experts: int, top_k: int,
                                  chosen: list[int] | None) -> None:
    """Both modes (one pair per block, aligned), forced, against the twin; the twin against
    the dense experts path on the independently dequantized weights."""
    # Latent 96: one K tile of 128 partly masked; the intermediate, 64, covers 2 N tiles.
    latent, inter = 96, 64
    gate_up, down, norm_weight = make_experts(fmt, num_experts, latent, inter, dtype,
                                              seed=num_tokens)
    norm_weight = norm_weight if norm else None
    weights, ids = routing(num_tokens, num_experts, top_k, seed=num_tokens, chosen=chosen)
    x = activations(num_tokens, latent, dtype, num_tokens, gate_up)
    flat = ids.reshape(-1)
    assert num_tokens == 1 or flat.unique().numel() < flat.numel()  # shared experts

    twin = fused_experts_torch(x, weights, ids, gate_up, down, norm_weight, 1e-6)
    dense = fused_experts_torch(x, weights, ids, bitwise_dequantize(gate_up).to(DEVICE, dtype),
                                bitwise_dequantize(down).to(DEVICE, dtype), norm_weight, 1e-6)
    assert torch.equal(twin, dense)
    for mode in (True, False):
        out = moe_triton.fused_experts(x, weights, ids, gate_up, down, norm_weight, 1e-6,
                                       one_pair_per_block=mode)
        assert out.dtype == dtype
        assert_close(out, twin, dtype)


def test_fused_experts_mixed_formats_and_prefill_tiles() -> None:
    """NVFP4 gate_up with dense down, and MXFP4 down with dense gate_up, on the aligned path
    with the 64-row prefill tiles (K tiles of 64 over a latent of 96)."""
    num_experts, latent, inter, dtype = 4, 96, 64, torch.float32
    nv_gate_up, _, norm = make_experts("nvfp4", num_experts, latent, inter, dtype, seed=11)
    _, mx_down, _ = make_experts("mxfp4", num_experts, latent, inter, dtype, seed=12)
    weights, ids = routing(40, num_experts, 2, seed=13)
    assert moe_triton.choose_tiles(80, num_experts).block_m == 64
    x = activations(40, latent, dtype, 14, nv_gate_up)
    for gate_up, down in ((nv_gate_up, dense_weight(mx_down, dtype)),
                          (dense_weight(nv_gate_up, dtype), mx_down)):
        twin = fused_experts_torch(x, weights, ids, gate_up, down, norm, 1e-6)
        out = moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)
        assert_close(out, twin, dtype)


def test_fused_experts_shape_check() -> None:
    gate_up, down, norm = make_experts("mxfp4", 2, 64, 32, torch.float32, seed=0)
    x = torch.zeros(1, 32, device=DEVICE)
    weights, ids = routing(1, 2, 1, seed=0)
    with pytest.raises(ValueError, match="gate_up"):
        moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fp4_decode_is_three_launches(monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    """With FP4 experts a decode call still runs no torch op but its output allocations."""
    launches = _record_launches(monkeypatch)
    gate_up, down, norm = make_experts(fmt, 16, 64, 32, torch.bfloat16, seed=0)
    weights, ids = routing(2, 16, 4, seed=0)
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16)
    with _OpLog() as log:
        moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)
    assert [flag for _, flag in launches[:2]] == [True, True]
    assert set(log.ops) == {"aten.empty.memory_format"} and len(log.ops) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays() -> None:
    dtype = torch.bfloat16
    gate_up, down, norm = make_experts("nvfp4", 8, 128, 64, dtype, seed=0)
    linear = random_weight("mxfp4", 96, 128, seed=1)
    weights, ids = routing(4, 8, 2, seed=0)
    static = {"x": activations(4, 128, dtype, 0, gate_up), "weights": weights, "ids": ids}

    def step() -> torch.Tensor:
        mixed = moe_triton.fused_experts(static["x"], static["weights"], static["ids"],
                                         gate_up, down, norm, 1e-6)
        return w4a16_linear_triton(mixed, linear)

    graph, out = capture(step)
    for seed, chosen in ((1, None), (2, [3])):
        weights, ids = routing(4, 8, 2, seed=seed, chosen=chosen)
        static["x"].copy_(activations(4, 128, dtype, seed, gate_up))
        static["weights"].copy_(weights)
        static["ids"].copy_(ids)
        graph.replay()
        mixed = fused_experts_torch(static["x"], weights, ids, gate_up, down, norm, 1e-6)
        assert_close(out, w4a16_linear_torch(mixed, linear), dtype)


# --- compiled code --------------------------------------------------------------------------

# Compiles the kernels for sm_90 through Triton's NVIDIA back end and ptxas, which need no GPU:
# the interpreter above runs the kernels' Python, not the compiler, so this catches what only
# the compiler rejects (non-constexpr globals, operand shapes tl.dot refuses, ...). Unit strides
# are constants, as Triton specialises them at launch; other integers and pointers are taken
# as 16-aligned.
_COMPILE_FOR_HOPPER = r"""
import triton
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import moe_triton, w4a16_triton

UNIT = {"stride_xk", "stride_xl", "stride_pk", "stride_sk", "stride_rn", "stride_yn",
        "stride_wk", "stride_hk", "stride_hn"}

packed = {"packed_ptr": "*u8", "scales_ptr": "*u8", "row_factor_ptr": "*fp32"}
for fmt, m in (("nvfp4", 1), ("mxfp4", 64)):
    tiles = w4a16_triton.choose_tiles(m, 2048, 4096)
    compile_for_hopper(
        w4a16_triton._w4a16_linear_kernel,
        dict(packed, x_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16"),
        dict(K=4096, SCALE_BLOCK=16 if fmt == "nvfp4" else 32,
             SCALE_E8M0=fmt == "mxfp4", HAS_ROW_FACTOR=fmt == "nvfp4", HAS_BIAS=m > 1,
             BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
             PRECISION="tf32", WIDEN=False),
        UNIT, tiles.num_warps, tiles.num_stages)
for fmt in ("nvfp4", "mxfp4"):
    block = 16 if fmt == "nvfp4" else 32
    gemv = w4a16_triton.choose_gemv_tiles(2048, 4096, block)
    compile_for_hopper(
        w4a16_triton._w4a16_gemv_kernel,
        dict(packed, x_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16", partial_ptr="*fp32",
             counter_ptr="*i32"),
        dict(K=4096, SCALE_BLOCK=block, SCALE_E8M0=fmt == "mxfp4",
             HAS_ROW_FACTOR=fmt == "nvfp4", HAS_BIAS=False, BLOCK_N=gemv.block_n,
             BLOCK_K=gemv.block_k, K_PER_PROGRAM=4096 // gemv.split_k, SPLIT=gemv.split_k),
        UNIT, gemv.num_warps)
prefill = moe_triton.choose_tiles(8192 * 8, 256)
prefill_gemm2 = (min(prefill.gemm2[0], moe_triton.FP4_MAX_GEMM2_BLOCK_N), *prefill.gemm2[1:])
for kernel, io, decode_tile, prefill_tile, prefill_tile_fp8 in (
        (moe_triton._gemm1_swiglu_kernel, dict(x_ptr="*bf16", h_ptr="*bf16"),
         moe_triton.DECODE_TILES.gemm1, prefill.gemm1, prefill.gemm1),
        (moe_triton._gemm2_kernel, dict(h_ptr="*bf16", y_ptr="*fp32"),
         moe_triton.DECODE_TILES.gemm2, prefill_gemm2, prefill.gemm2)):
    for fmt, block_m, (block_n, block_k, num_warps, num_stages) in (
            ("fp4", 16, decode_tile), ("fp4", prefill.block_m, prefill_tile),
            ("fp8", 16, decode_tile), ("fp8", prefill.block_m, prefill_tile_fp8),
            ("fp8-block", 16, decode_tile), ("fp8-block", prefill.block_m, prefill_tile_fp8),
            ("dense", 16, decode_tile)):
        fp4, quantized, blocks = fmt == "fp4", fmt != "dense", fmt == "fp8-block"
        weight = "*u8" if quantized else "*bf16"
        pointers = dict(io, w_ptr=weight, scales_ptr="*u8" if fp4 else "*fp32" if blocks
                        else weight, row_factor_ptr="*fp32" if quantized else weight,
                        sorted_pairs_ptr="*i64", block_expert_ptr="*i64")
        compile_for_hopper(
            kernel, pointers,
            dict(LATENT=1024, INTER=640, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_K=min(block_k, 128), PRECISION="tf32", WIDEN=False,
                 ONE_PAIR_PER_BLOCK=block_m == 16, FP4=fp4, FP8=fmt.startswith("fp8"),
                 SCALE_BLOCK=16 if fp4 else 1, SCALE_E8M0=False,
                 HAS_ROW_FACTOR=quantized and not blocks, GEMV=fp4 and block_m == 16,
                 FP8_BLOCK_N=128 if blocks else 0, FP8_BLOCK_K=128 if blocks else 0,
                 PDL=True),
            UNIT, num_warps, num_stages)
print("compiled")
"""


def test_kernels_compile_for_hopper() -> None:
    """The linear kernel (NVFP4 decode, MXFP4 at 64 rows), the one-row GEMV and the fused
    experts' GEMMs (FP4, FP8 with row and with block scales at decode and prefill tiles,
    dense at decode) compile for sm_90 with the tiles the launchers pick, launched with PDL."""
    assert_script_compiles(_COMPILE_FOR_HOPPER)
"""Fused experts on FP8 E4M3 weights (W8A16): the Triton GEMMs vs the torch twin vs a decode
written out bit by bit, and `Fp8MoEMethod` handing the stored weights to the experts kernel.

The twin dequantizes (e4m3 * row scale in float32, rounded to the activation dtype) and runs
the dense experts; it must equal that computation on independently decoded weights exactly.
The kernels' weight tile must be the twin's weight bit for bit, and whole calls agree with the
twin to GEMM tolerance. Sizes are small: the kernels run under Triton's interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from muse.kernels import moe_triton  # noqa: E402
from muse.kernels.moe import fused_experts_torch  # noqa: E402
from muse.kernels.w8a16 import Fp8Weight  # noqa: E402
from muse.quantization.common import WeightOnlyMoEMethod  # noqa: E402
from muse.quantization.common import expert_param  # noqa: E402
from muse.quantization.fp8 import Fp8MoEMethod, Fp8Scheme, dequantize  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402
from tests.kernels.graph_capture import capture  # noqa: E402
from tests.kernels.test_moe import _OpLog, _record_launches  # noqa: E402
from tests.kernels.test_w4a16 import (  # noqa: E402, F401 (the fixture applies here too)
    assert_close,
    round_bfloat16_to_nearest,
    routing,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def random_fp8(out: int, inp: int, *, experts: int, parts: int = 1, per_row: bool = False,
               seed: int = 0) -> Fp8Weight:
    """Random E4M3 values over the whole range (subnormals to 448, both signs) with scales
    that bring them to order 1 / sqrt(inp): one per part of the rows (a per-tensor checkpoint's
    gate and up, expanded) or, with `per_row`, one per row (per channel)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(experts, out, inp, generator=gen) * 2.0 ** torch.randint(
        -6, 8, (experts, out, inp), generator=gen)
    weight = values.clamp(-448, 448).to(torch.float8_e4m3fn)
    groups = out if per_row else parts
    scale = torch.exp2(torch.empty(experts, groups).uniform_(-3, 1, generator=gen))
    scale = scale / values.abs().mean() / inp ** 0.5
    rows = scale.repeat_interleave(out // groups, dim=-1)[..., None]
    return Fp8Weight(weight.to(DEVICE), rows.to(DEVICE))


def bitwise_dequantize(weight: Fp8Weight) -> torch.Tensor:
    """float32 [..., out, in] decoded from the bits in float64: E4M3 (s, e3..e0, m2..m0) is
    (-1)^s (e ? (1 + m/8) 2^(e-7) : m/8 2^-6). The float64 product with the scale is exact,
    so its one rounding to float32 is the twin's."""
    codes = weight.weight_bytes.cpu().to(torch.int64)
    e, m = ((codes >> 3) & 0xF).double(), (codes & 7).double()
    values = torch.where(e > 0, (1 + m / 8) * 2.0 ** (e - 7), m / 8 * 2.0 ** -6)
    values = values * (1.0 - 2.0 * (codes >> 7).double())
    scale = weight.scale.cpu().double()
    if weight.block is not None:
        (block_n, block_k), (out, inp) = weight.block, codes.shape[-2:]
        scale = scale.repeat_interleave(block_n, dim=-2)[..., :out, :]
        scale = scale.repeat_interleave(block_k, dim=-1)[..., :inp]
    return (values * scale).to(torch.float32)


def make_experts(num_experts: int, latent: int, inter: int, dtype: torch.dtype, seed: int
                 ) -> tuple[Fp8Weight, Fp8Weight, torch.Tensor]:
    """gate_up with a scale per part (gate, up), down with a scale per row, expert norms."""
    gate_up = random_fp8(2 * inter, latent, experts=num_experts, parts=2, seed=seed)
    down = random_fp8(latent, inter, experts=num_experts, per_row=True, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    norm = (1 + 0.2 * torch.randn(num_experts, latent, generator=gen)).to(DEVICE, dtype)
    return gate_up, down, norm


def block_scaled(weight: Fp8Weight, block: tuple[int, int], seed: int) -> Fp8Weight:
    """The same E4M3 values with a scale per block of rows x inputs (of many octaves)."""
    out, inp = weight.shape[-2:]
    grid = (weight.shape[0], -(-out // block[0]), -(-inp // block[1]))
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.empty(grid).uniform_(-4, 2, generator=gen)) / 64 / inp ** 0.5
    return Fp8Weight(weight.weight, scale.to(DEVICE), block)


def activations(num_tokens: int, latent: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, latent, generator=gen).to(DEVICE, dtype)


# --- the descriptor and the weight tile ------------------------------------------------------


def test_dequantize_matches_bitwise_decode() -> None:
    """Every finite E4M3 byte, under row scales of many octaves."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes.repeat(2, 5, 1).view(torch.float8_e4m3fn)
    scale = torch.exp2(torch.linspace(-40, 40, 10)).reshape(2, 5, 1)
    fp8 = Fp8Weight(weight, scale)
    assert fp8.shape == (2, 5, codes.numel())
    assert torch.equal(fp8.dequantize(), bitwise_dequantize(fp8))


def test_fp8_weight_checks() -> None:
    weight = torch.zeros(2, 4, 8).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="weight"):
        Fp8Weight(weight.view(torch.uint8), torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="scale"):
        Fp8Weight(weight, torch.ones(2, 4))
    with pytest.raises(ValueError, match="scale"):
        Fp8Weight(weight, torch.ones(2, 4, 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"scale must be float32 \[2, 2, 1\]"):
        Fp8Weight(weight, torch.ones(2, 4, 1), block=(2, 8))
    assert Fp8Weight(weight, torch.ones(2, 2, 1), block=(3, 8)).block == (3, 8)


@triton.jit
def _tile_kernel(w_ptr, scale_ptr, out_ptr, K: tl.constexpr, N: tl.constexpr):
    """out [K, N] = `_fp8_tile` of the [N, K] weight's bytes, read as the GEMMs read them."""
    ks, ns = tl.arange(0, K), tl.arange(0, N)
    raw = tl.load(w_ptr + ns[None, :] * K + ks[:, None])
    tile = moe_triton._fp8_tile(raw, tl.load(scale_ptr + ns), out_ptr.dtype.element_ty)
    tl.store(out_ptr + ks[:, None] * N + ns[None, :], tile)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_kernel_weight_tile_is_the_twins(dtype: torch.dtype) -> None:
    """The kernels' tile is the twin's weight rounded to the activation dtype, bit for bit:
    every byte (the two NaNs made zeros) under row scales of many octaves (float16: as many as
    keep 448 * scale inside its range)."""
    codes = torch.arange(256)
    codes[codes & 0x7F == 0x7F] = 0
    weight = codes.to(torch.uint8).repeat(32, 1).view(torch.float8_e4m3fn)
    low, high = (-8, 7) if dtype == torch.float16 else (-60, 60)
    scale = torch.exp2(torch.linspace(low, high, 32))[:, None]
    fp8 = Fp8Weight(weight.to(DEVICE), scale.to(DEVICE))
    out = torch.empty(256, 32, dtype=dtype, device=DEVICE)
    _tile_kernel[(1,)](fp8.weight_bytes, fp8.scale, out, K=256, N=32)
    assert torch.equal(out, fp8.dequantize().to(dtype).t())


# --- fused experts ---------------------------------------------------------------------------

MOE_CASES = [
    # (tokens, experts, top_k, chosen, latent, inter): decode sizes with experts repeated
    # across tokens; latent 96 is one K tile of 128 partly masked, inter 64 two N tiles; the
    # last case's widths no tile divides.
    (1, 8, 4, None, 96, 64),
    (3, 8, 2, [1, 6], 96, 64),
    (5, 8, 2, [0, 3], 40, 24),
]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "chosen", "latent", "inter"),
                         MOE_CASES)
def test_fused_experts_match_twin(dtype: torch.dtype, norm: bool, num_tokens: int,
                                  num_experts: int, top_k: int, chosen: list[int] | None,
                                  latent: int, inter: int) -> None:
    """Both modes (one pair per block, aligned), forced, against the twin; the twin against
    the dense experts path on the independently decoded weights."""
    gate_up, down, norm_weight = make_experts(num_experts, latent, inter, dtype, seed=num_tokens)
    norm_weight = norm_weight if norm else None
    weights, ids = routing(num_tokens, num_experts, top_k, seed=num_tokens, chosen=chosen)
    x = activations(num_tokens, latent, dtype, num_tokens)
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


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("block", "latent", "inter"), [((16, 32), 96, 64), ((32, 16), 40, 24)])
def test_block_scaled_experts_match_twin(dtype, block, latent, inter) -> None:
    """128 x 128 blocks in small: K tiles shrink to the scale block, the up rows' blocks
    follow the gate rows', widths no block divides; both modes, decode and prefill tiles."""
    gate_up, down, norm = make_experts(8, latent, inter, dtype, seed=3)
    gate_up, down = block_scaled(gate_up, block, 4), block_scaled(down, block, 5)
    for tokens, top_k in ((1, 4), (40, 2)):
        weights, ids = routing(tokens, 8, top_k, seed=tokens)
        x = activations(tokens, latent, dtype, tokens)
        twin = fused_experts_torch(x, weights, ids, gate_up, down, norm, 1e-6)
        dense = fused_experts_torch(x, weights, ids,
                                    bitwise_dequantize(gate_up).to(DEVICE, dtype),
                                    bitwise_dequantize(down).to(DEVICE, dtype), norm, 1e-6)
        assert torch.equal(twin, dense)
        for mode in (True, False):
            out = moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6,
                                           one_pair_per_block=mode)
            assert_close(out, twin, dtype)


def test_fused_experts_mixed_formats_and_prefill_tiles() -> None:
    """FP8 gate_up with dense down and the reverse, on the aligned path with the 64-row
    prefill tiles (K tiles of 64 over a latent of 96)."""
    num_experts, latent, inter, dtype = 4, 96, 64, torch.float32
    gate_up, down, norm = make_experts(num_experts, latent, inter, dtype, seed=11)
    weights, ids = routing(40, num_experts, 2, seed=13)
    assert moe_triton.choose_tiles(80, num_experts).block_m == 64
    x = activations(40, latent, dtype, 14)
    for pair in ((gate_up, down.dequantize()), (gate_up.dequantize(), down)):
        twin = fused_experts_torch(x, weights, ids, *pair, norm, 1e-6)
        out = moe_triton.fused_experts(x, weights, ids, *pair, norm, 1e-6)
        assert_close(out, twin, dtype)


def test_fp8_decode_is_three_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8 experts a decode call still runs no torch op but its output allocations."""
    launches = _record_launches(monkeypatch)
    gate_up, down, norm = make_experts(16, 64, 32, torch.bfloat16, seed=0)
    weights, ids = routing(2, 16, 4, seed=0)
    x = activations(2, 64, torch.bfloat16, 0)
    with _OpLog() as log:
        moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)
    assert [name for name, _ in launches] == [
        "_gemm1_swiglu_kernel", "_gemm2_kernel", "_moe_combine_kernel"]
    assert [flag for _, flag in launches[:2]] == [True, True]
    assert set(log.ops) == {"aten.empty.memory_format"} and len(log.ops) == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays() -> None:
    dtype = torch.bfloat16
    gate_up, down, norm = make_experts(8, 128, 64, dtype, seed=0)
    weights, ids = routing(4, 8, 2, seed=0)
    static = {"x": activations(4, 128, dtype, 0), "weights": weights, "ids": ids}
    graph, out = capture(lambda: moe_triton.fused_experts(
        static["x"], static["weights"], static["ids"], gate_up, down, norm, 1e-6))
    for seed, chosen in ((1, None), (2, [3])):
        weights, ids = routing(4, 8, 2, seed=seed, chosen=chosen)
        static["x"].copy_(activations(4, 128, dtype, seed))
        static["weights"].copy_(weights)
        static["ids"].copy_(ids)
        graph.replay()
        assert_close(out, fused_experts_torch(static["x"], weights, ids, gate_up, down, norm,
                                              1e-6), dtype)


# --- Fp8MoEMethod ----------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_moe_method_hands_stored_weights_to_the_kernel(strategy: str) -> None:
    """Per-tensor, per-channel and block-scaled experts reach the experts kernel as
    `Fp8Weight`s with the same output as the dequantize-then-multiply path."""
    num_experts, latent, inter, dtype = 4, 32, 16, torch.bfloat16
    scheme = Fp8Scheme(strategy, (8, 8) if strategy == "block" else None)
    method = Fp8MoEMethod(scheme)
    received: list = []

    def kernel(x, weights, ids, gate_up, down, *rest, **kwargs):
        received.extend([gate_up, down])
        return fused_experts_torch(x, weights, ids, gate_up, down, *rest, **kwargs)

    layer = nn.Module()
    layer.experts_kernel, layer.norm_weight, layer.eps = kernel, None, 1e-6
    method.create_weights(layer, num_experts, latent, inter, dtype, weight_loader=None)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dtype == torch.float8_e4m3fn:
                param.copy_(torch.randn(param.shape, generator=gen) * 8)
            else:
                param.copy_(torch.rand(param.shape, generator=gen) / 64 + 1 / 128)
    layer.to(DEVICE)
    method.process_weights_after_loading(layer)
    weights, ids = routing(3, num_experts, 2, seed=1)
    x = activations(3, latent, dtype, 2)

    out = method.apply(layer, x, weights, ids)
    expected = WeightOnlyMoEMethod.apply(method, layer, x, weights, ids)
    assert torch.equal(out, expected)
    assert received[0] is layer.fp8["gate_up"] and received[1] is layer.fp8["down"]
    assert torch.equal(method.dequantized(layer, "down"), layer.fp8["down"].dequantize())
    # The linear layers' dequantization of the same tensors agrees (blocks too).
    weight = getattr(layer, expert_param("down", "weight"))
    scale = getattr(layer, expert_param("down", method.scheme.scale_name))
    if strategy != "tensor":
        assert torch.equal(layer.fp8["down"].dequantize(), dequantize(weight, scale, scheme))
    assert layer.fp8["down"].block == ((8, 8) if strategy == "block" else None)

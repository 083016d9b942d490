"""FP8 W8A8 linears: the plain-PyTorch twin against a straightforward reference, the
`torch._scaled_mm` path against the twin (rowwise on CPU, where torch has that kernel too;
everything on CUDA with FP8 tensor cores), the scale shapes `_scaled_mm` takes, and how an
FP8 linear chooses its path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from muse.kernels.fp8_gemm import (FP8, fp8_linear_scaled_mm, fp8_linear_torch,
                                   quantize_fp8_per_group, quantize_fp8_per_token,
                                   scaled_mm_shapes_ok, scaled_mm_supported)
from muse.layers.linear import QKVParallelLinear, RowParallelLinear
from muse.quantization import fp8 as fp8_module
from muse.quantization.common import QuantOptions, quant_options
from muse.quantization.fp8 import (FP8_GEMM, W8A8_EMULATED, W8A16, Fp8LinearMethod, Fp8Scheme,
                                   choose_path)
from muse.layers.quantization import QuantizationConfig

HAS_FP8_GEMM = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(not HAS_FP8_GEMM,
                                   reason="FP8 tensor cores need CUDA compute capability 8.9+")


def e4m3_values() -> torch.Tensor:
    """The float8_e4m3fn value of every code 0..255 (float64; NaN for the two NaN codes)."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).double()


def round_e4m3_reference(values: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 value of each entry (float64), ties to the even code, saturating at 448:
    by search over the value table, independent of torch's cast."""
    table = e4m3_values()
    codes = torch.arange(256)
    finite = torch.isfinite(table)
    table, codes = table[finite], codes[finite]
    flat = values.double().clamp(-448, 448).reshape(-1, 1)
    distance = (flat - table).abs()
    best = distance.min(-1, keepdim=True).values
    candidates = distance == best
    # among equally near values, the even code (the one whose mantissa ends in 0)
    even = candidates & (codes % 2 == 0)
    pick = torch.where(even.any(-1, keepdim=True), even, candidates).float().argmax(-1)
    return table[pick].reshape(values.shape)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: float | None = None, group: int | None = None,
                     block: tuple[int, int] | None = None) -> torch.Tensor:
    """Token by token (and group by group): scale from the amax, E4M3 rounding by table,
    dequantized operands multiplied in float64."""
    rows = []
    if block is None:
        w = weight.double() * weight_scale.double().reshape(-1, 1)
    else:
        w = weight.double().clone()
        for i in range(weight_scale.shape[0]):
            for j in range(weight_scale.shape[1]):
                w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= \
                    weight_scale[i, j].double()
    for row in x.reshape(-1, x.shape[-1]).double():
        pieces = row.split(group) if group else [row]
        dequantized = []
        for piece in pieces:
            # scale and division in float32, as the twin computes them
            amax = max(piece.float().abs().max().item(), 1e-12)
            scale = torch.tensor(amax, dtype=torch.float32) / 448 if input_scale is None \
                else torch.tensor(input_scale, dtype=torch.float32)
            scaled = (piece.float() / scale).double()
            dequantized.append(round_e4m3_reference(scaled) * scale.double())
        rows.append(torch.cat(dequantized) @ w.t())
    return torch.stack(rows).reshape(*x.shape[:-1], weight.shape[0])


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 twins: float32 accumulation against float64, relative to the output's range;
    bfloat16 ones: within the output's rounding."""
    relative = 1e-5 if got.dtype == torch.float32 else 1e-2
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=relative, atol=relative * scale)


def random_fp8_weight(out: int, inp: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(out, inp, generator=generator) * 100).clamp(-448, 448).to(FP8)


def activations(shape: tuple[int, ...], dtype: torch.dtype,
                generator: torch.Generator) -> torch.Tensor:
    """Random rows of very different magnitudes (and an all-zero row)."""
    x = torch.randn(shape, generator=generator) * torch.rand(*shape[:-1], 1,
                                                             generator=generator) * 8
    x.reshape(-1, shape[-1])[0] = 0
    return x.to(dtype)


def test_e4m3_reference_agrees_with_torch_cast():
    """The reference rounding is the cast's (so the reference tests the rest of the twin)."""
    values = torch.randn(4096, generator=torch.Generator().manual_seed(0)).float() * 300
    table = e4m3_values()
    finite = table[torch.isfinite(table)].float()
    midpoints = (finite.sort().values[1:] + finite.sort().values[:-1]) / 2
    values = torch.cat([values, midpoints, torch.tensor([448.0, -448.0, 1e-9, 0.0])])
    torch.testing.assert_close(round_e4m3_reference(values).float(),
                               values.clamp(-448, 448).to(FP8).float(), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("static", [False, True])
def test_rowwise_twin_matches_reference(dtype, static):
    generator = torch.Generator().manual_seed(1)
    x = activations((2, 3, 64), dtype, generator)
    weight = random_fp8_weight(48, 64, generator)
    scale = torch.rand(48, generator=generator) / 100 + 1e-3
    input_scale = 0.01 if static else None
    got = fp8_linear_torch(x, weight, scale,
                           torch.tensor([input_scale]) if static else None)
    assert got.dtype == dtype and got.shape == (2, 3, 48)
    assert_matches(got, reference_linear(x, weight, scale, input_scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_twin_matches_reference(dtype):
    generator = torch.Generator().manual_seed(2)
    x = activations((5, 256), dtype, generator)
    weight = random_fp8_weight(384, 256, generator)
    scale = torch.rand(3, 2, generator=generator) / 100 + 1e-3
    got = fp8_linear_torch(x, weight, scale, block=(128, 128))
    assert_matches(got, reference_linear(x, weight, scale, group=128, block=(128, 128)))


def test_bias_is_added_in_the_activation_dtype():
    generator = torch.Generator().manual_seed(3)
    x = activations((4, 32), torch.bfloat16, generator)
    weight, scale = random_fp8_weight(16, 32, generator), torch.full((16,), 0.01)
    bias = torch.randn(16, generator=generator).to(torch.bfloat16)
    torch.testing.assert_close(fp8_linear_torch(x, weight, scale, bias=bias),
                               fp8_linear_torch(x, weight, scale) + bias, atol=0, rtol=0)


def test_scale_shapes_for_scaled_mm():
    """Rowwise: scale_a [M, 1] and scale_b [1, N], float32 and contiguous; a static scale is
    expanded to [M, 1]; 1 x 128 groups give [M, K / 128]."""
    x = torch.randn(7, 256, dtype=torch.bfloat16)
    quantized, scale = quantize_fp8_per_token(x)
    assert quantized.dtype == FP8 and quantized.shape == (7, 256) and quantized.is_contiguous()
    assert scale.shape == (7, 1) and scale.dtype == torch.float32 and scale.is_contiguous()
    _, static = quantize_fp8_per_token(x, torch.tensor([0.5]))
    assert static.shape == (7, 1) and static.is_contiguous() and bool((static == 0.5).all())
    weight_scale = torch.rand(48)
    assert weight_scale.reshape(1, -1).shape == (1, 48) and weight_scale.reshape(1, -1)\
        .is_contiguous()
    quantized, groups = quantize_fp8_per_group(x, 128)
    assert quantized.shape == (7, 256) and groups.shape == (7, 2)
    # the column-major weight view _scaled_mm takes
    weight = torch.zeros(48, 256, dtype=FP8)
    assert weight.t().stride() == (1, 256)


def test_scaled_mm_rowwise_matches_twin_on_cpu():
    """torch has a rowwise `_scaled_mm` on CPU too: the call's operands and scales mean what
    the twin computes (bf16 output then x's dtype; here float32 accumulation both)."""
    generator = torch.Generator().manual_seed(4)
    for dtype, static in [(torch.bfloat16, None), (torch.float32, torch.tensor([0.02]))]:
        x = activations((3, 5, 64), dtype, generator)
        weight = random_fp8_weight(32, 64, generator)
        scale = torch.rand(32, generator=generator) / 100
        try:
            got = fp8_linear_scaled_mm(x, weight, scale, static)
        except (RuntimeError, NotImplementedError) as error:
            pytest.skip(f"no CPU _scaled_mm in this torch build: {error}")
        want = fp8_linear_torch(x, weight, scale, static)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_fp8_gemm_is_never_chosen_on_cpu():
    assert not scaled_mm_supported(torch.device("cpu"))
    assert not scaled_mm_supported(torch.device("cpu"), (128, 128))


def test_shapes_the_fp8_gemm_takes():
    assert scaled_mm_shapes_ok(48, 64, None) and not scaled_mm_shapes_ok(40, 72, None)
    assert scaled_mm_shapes_ok(256, 384, (128, 128))
    assert not scaled_mm_shapes_ok(256, 320, (128, 128))  # a partial block of K
    assert not scaled_mm_shapes_ok(256, 256, (64, 64))


@pytest.mark.parametrize("scheme, shape, options, gemm, want", [
    (Fp8Scheme("channel"), (64, 64), QuantOptions(), True, FP8_GEMM),
    (Fp8Scheme("channel"), (64, 64), QuantOptions(weight_only=True), True, W8A16),
    (Fp8Scheme("channel"), (64, 64), QuantOptions(), False, W8A16),
    (Fp8Scheme("channel"), (64, 64), QuantOptions(emulate_activations=True), False,
     W8A8_EMULATED),
    (Fp8Scheme("tensor", static_input_scale=True), (40, 64), QuantOptions(), True, W8A16),
    (Fp8Scheme("block", (128, 128)), (256, 256), QuantOptions(), True, FP8_GEMM),
    (Fp8Scheme("block", (128, 128), static_input_scale=True), (256, 256), QuantOptions(),
     True, W8A16),
    (Fp8Scheme("block", (64, 64)), (256, 256), QuantOptions(emulate_activations=True), True,
     W8A8_EMULATED),
])
def test_path_choice(monkeypatch, scheme, shape, options, gemm, want):
    monkeypatch.setattr(fp8_module, "scaled_mm_supported", lambda device, block=None: gemm)
    assert choose_path(scheme, options, torch.device("cuda"), *shape) == want


class _Fp8Config(QuantizationConfig):
    def __init__(self, scheme: Fp8Scheme) -> None:
        self.scheme = scheme

    def get_quant_method(self, layer, prefix):
        return Fp8LinearMethod(self.scheme)


def _fp8_qkv(scheme: Fp8Scheme, generator: torch.Generator) -> QKVParallelLinear:
    """q/k/v of 2 query heads and 1 kv head of 32 over 64 features, random FP8 weights, each
    part its own per-tensor scale (and static input scale)."""
    layer = QKVParallelLinear(64, 32, 2, 1, quant_config=_Fp8Config(scheme), prefix="qkv")
    layer.weight.data.copy_(random_fp8_weight(128, 64, generator))
    layer.weight_scale.data.copy_(torch.tensor([0.01, 0.02, 0.005]))
    if scheme.static_input_scale:
        layer.input_scale.data.copy_(torch.tensor([0.02, 0.03, 0.01]))
    return layer


def test_emulated_layer_runs_the_twin_with_the_largest_input_scale():
    generator = torch.Generator().manual_seed(5)
    scheme = Fp8Scheme("tensor", static_input_scale=True)
    with quant_options(QuantOptions(emulate_activations=True)):
        layer = _fp8_qkv(scheme, generator)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_path == W8A8_EMULATED
    x = activations((6, 64), torch.float32, generator)
    rows = torch.tensor([0.01] * 64 + [0.02] * 32 + [0.005] * 32)
    want = fp8_linear_torch(x, layer.weight, rows, torch.tensor([0.03]))
    torch.testing.assert_close(layer(x), want, atol=0, rtol=0)
    # W8A16 on the same weights: the dequantized weight, activations as they are
    layer.quant_method = Fp8LinearMethod(scheme, QuantOptions())
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_path == W8A16
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight.float() * rows[:, None]))


def test_default_on_cpu_is_weight_only():
    generator = torch.Generator().manual_seed(6)
    layer = RowParallelLinear(64, 32, quant_config=_Fp8Config(Fp8Scheme("channel")),
                              prefix="o")
    layer.weight.data.copy_(random_fp8_weight(32, 64, generator))
    layer.weight_scale.data.copy_(torch.rand(32, 1, generator=generator) / 100)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8_path == W8A16


@needs_fp8_gpu
@pytest.mark.parametrize("case", ["dynamic", "static", "block"])
def test_scaled_mm_matches_twin_on_gpu(case):
    """The FP8 GEMM against the twin on the same quantized operands: they differ by the
    accumulation order and the bfloat16 output's rounding."""
    block = (128, 128) if case == "block" else None
    if not scaled_mm_supported(torch.device("cuda"), block):
        pytest.skip(f"torch._scaled_mm has no {case} scaling on this GPU / build")
    generator = torch.Generator().manual_seed(7)
    x = activations((3, 37, 512), torch.bfloat16, generator).cuda()
    weight = random_fp8_weight(384, 512, generator).cuda()
    grid = (3, 4) if block else (384,)
    scale = (torch.rand(grid, generator=generator) / 100 + 1e-3).cuda()
    static = torch.tensor([0.01], device="cuda") if case == "static" else None
    bias = torch.randn(384, generator=generator).to("cuda", torch.bfloat16)
    got = fp8_linear_scaled_mm(x, weight, scale, static, bias, block)
    want = fp8_linear_torch(x, weight, scale, static, bias, block)
    assert got.dtype == torch.bfloat16 and got.shape == (3, 37, 384)
    # Sums of 512 products as large as the largest output, added in another order, differ by
    # float32 roundings of that size (about 2^-12 of it with margin), visible where an output
    # is near zero; a wrong scale layout errs by the outputs' own size.
    atol = float(want.float().abs().max()) * 2.0 ** -12
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=atol)


@needs_fp8_gpu
def test_layer_takes_the_fp8_gemm_on_gpu():
    generator = torch.Generator().manual_seed(8)
    scheme = Fp8Scheme("tensor", static_input_scale=True)
    with quant_options(QuantOptions()):
        layer = _fp8_qkv(scheme, generator).cuda()
    layer.quant_method.process_weights_after_loading(layer)
    if not scaled_mm_supported(torch.device("cuda")):
        pytest.skip("no rowwise torch._scaled_mm on this GPU / build")
    assert layer.fp8_path == FP8_GEMM
    x = activations((9, 64), torch.bfloat16, generator).cuda()
    want = fp8_linear_torch(x, layer.weight, layer.gemm_weight_scale, layer.gemm_input_scale)
    torch.testing.assert_close(layer(x).float(), want.float(), rtol=2e-2, atol=2e-2)

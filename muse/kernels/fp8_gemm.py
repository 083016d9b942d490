"""FP8 E4M3 linears with quantized activations (W8A8) on FP8 tensor cores, and their twin.

    y = dequant(quantize(x)) @ dequant(W)^T

The weight is float8_e4m3fn `[N, K]` with float32 scales, one of two ways:

- rowwise: one scale per output row, `weight_scale` `[N]` (a per-tensor or per-part scale
  repeated over its rows, or per-channel scales). Activations are quantized per token:
  scale = max(row amax, 1e-12) / 448, or the checkpoint's static `input_scale` (one float32
  scalar) when given; x_fp8 = clamp(x / scale, +-448) rounded to E4M3 (nearest even).
- block: one scale per (bn, bk) block of the weight, `weight_scale` `[ceil(N / bn),
  ceil(K / bk)]` (DeepSeek-style 128 x 128). Activations are quantized per token and group
  of bk input features (the same rule per group), K a multiple of bk.

`fp8_linear_scaled_mm` runs it with `torch._scaled_mm` (CUDA, compute capability >= 8.9):
rowwise scaling takes scale_a `[M, 1]` and scale_b `[1, N]`, block scaling (128 x 128 only)
takes scale_a `[M, K / 128]` outer-dim-major and scale_b the `[N / 128, K / 128]` grid
transposed; the weight goes in column-major (`weight.t()` of the row-major `[N, K]`), K and N
multiples of 16; the output is bfloat16, cast to x's dtype, and the bias is added after.

`fp8_linear_torch` is its plain-PyTorch twin (any device): the same activation quantization
(the same rounding; on CUDA the rowwise case runs as one Triton launch,
`muse.kernels.fp8_quant_triton`, tested against it byte for byte), then dequantized operands
multiplied in float32 and rounded to x's dtype. The two differ only in accumulation order and
the GEMM's bfloat16 output rounding.

`scaled_mm_supported(device, block)` says whether the FP8 GEMM runs on a device: the compute
capability, then, once per device and scaling kind, a small probe GEMM compared with the
twin (a torch build or cuBLAS without that scaling raises, a layout it reads differently
mismatches); quant methods fall back to another path when it says no.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("muse")

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_AMAX = 1e-12  # keeps an all-zero row's scale positive
MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
SCALED_MM_BLOCK = (128, 128)  # the only weight block torch._scaled_mm scales
ALIGN = 16  # K and N of torch._scaled_mm


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 rounded once, on every device: CUDA divides by a Python scalar as a
    multiplication by its reciprocal (another rounding), the Triton kernels divide."""
    return amax / torch.full_like(amax, FP8_MAX)


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] row-major, scale [M, 1] float32 contiguous), x ~ x_fp8 *
    scale; dynamic (row amax / 448) unless a static scalar `input_scale` is given."""
    values = x.float()
    if input_scale is None:
        scale = _over_fp8_max(values.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX))
    else:
        scale = input_scale.float().reshape(1, 1).expand(values.shape[0], 1).contiguous()
    return (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_fp8_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, K / group] float32): the per-token rule applied to
    every `group` consecutive features of a row."""
    rows, width = x.shape
    if width % group:
        raise ValueError(f"per-group FP8 activations need K ({width}) divisible by {group}")
    values = x.float().reshape(rows, width // group, group)
    scale = _over_fp8_max(values.abs().amax(-1, keepdim=True).clamp(min=MIN_AMAX))
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return quantized.reshape(rows, width), scale.squeeze(-1)


def _dequantize_weight(weight: torch.Tensor, weight_scale: torch.Tensor,
                       block: tuple[int, int] | None) -> torch.Tensor:
    values = weight.float()
    if block is None:
        return values * weight_scale.float().reshape(-1, 1)
    rows, cols = block
    out, inp = weight.shape
    expanded = weight_scale.float().repeat_interleave(rows, 0)[:out]
    return values * expanded.repeat_interleave(cols, 1)[:, :inp]


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: W8A8 numerics in plain PyTorch (the twin of
    `fp8_linear_scaled_mm`). weight float8_e4m3fn [N, K]; weight_scale [N] (rowwise) or the
    block grid (block = (bn, bk)); input_scale: a static activation scale (rowwise only)."""
    flat = x.reshape(-1, x.shape[-1])
    if block is None:
        quantized, scale = quantize_fp8_per_token(flat, input_scale)
        activations = quantized.float() * scale
    else:
        if input_scale is not None:
            raise ValueError("block-scaled FP8 quantizes activations per token and group; "
                             "a static input scale does not apply")
        quantized, scale = quantize_fp8_per_group(flat, block[1])
        groups = quantized.float().reshape(flat.shape[0], -1, block[1]) * scale[..., None]
        activations = groups.reshape(flat.shape)
    out = (activations @ _dequantize_weight(weight, weight_scale, block).t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         input_scale: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None,
                         block: tuple[int, int] | None = None) -> torch.Tensor:
    """`fp8_linear_torch` on FP8 tensor cores (CUDA): `torch._scaled_mm`, float32 accumulation,
    a bfloat16 result. weight_scale contiguous float32: [N] (rowwise) or the [N / 128, K / 128]
    grid (block = (128, 128)). No host synchronisation (CUDA-graph capturable)."""
    flat = x.reshape(-1, x.shape[-1])
    if block is None:
        # Imported here: that module takes its constants from this one.
        from muse.kernels.fp8_quant_triton import quantize_fp8_per_token_triton

        quantize = quantize_fp8_per_token_triton if flat.is_cuda else quantize_fp8_per_token
        quantized, scale_a = quantize(flat, input_scale)
        scale_b = weight_scale.reshape(1, -1)
    else:
        if tuple(block) != SCALED_MM_BLOCK or input_scale is not None:
            raise ValueError(f"torch._scaled_mm scales {SCALED_MM_BLOCK} weight blocks with "
                             f"dynamic activations, not {tuple(block)}"
                             + (" with a static input scale" if input_scale is not None else ""))
        quantized, scale_a = quantize_fp8_per_group(flat, block[1])
        scale_a = scale_a.t().contiguous().t()  # 1 x 128 scales are read outer-dim-major
        scale_b = weight_scale.t()  # the grid as [K / 128, N / 128], row-major underneath
    out = torch._scaled_mm(quantized, weight.t(), scale_a, scale_b, out_dtype=torch.bfloat16)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def scaled_mm_shapes_ok(out_features: int, in_features: int,
                        block: tuple[int, int] | None) -> bool:
    """Whether `fp8_linear_scaled_mm` takes a weight of this shape and blocking."""
    if block is None:
        return out_features % ALIGN == 0 and in_features % ALIGN == 0
    rows, cols = SCALED_MM_BLOCK
    return tuple(block) == SCALED_MM_BLOCK and out_features % rows == 0 \
        and in_features % cols == 0


_SUPPORTED: dict[int, bool] = {}


def scaled_mm_supported(device: torch.device, block: tuple[int, int] | None = None) -> bool:
    """Whether `fp8_linear_scaled_mm` runs on `device` with this kind of weight scaling:
    CUDA with compute capability >= 8.9 whose probe GEMM matched the twin (probed once per
    device; never on CPU), and rowwise scales only."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() \
            or not hasattr(torch, "_scaled_mm"):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < MIN_CAPABILITY:
        return False
    if block is not None:
        # torch 2.11's cuBLAS on the H200 refuses some block-scaled shapes at run time
        # (CUBLAS_STATUS_NOT_SUPPORTED for 111 rows while a 24-row probe passes): a step's
        # row count varies, so block-scaled weights run W8A16 rather than risk it.
        return False
    if index not in _SUPPORTED:
        _SUPPORTED[index] = _probe(torch.device("cuda", index))
    return _SUPPORTED[index]


def _probe(device: torch.device) -> bool:
    generator = torch.Generator().manual_seed(0)
    out_features, in_features, tokens = 256, 512, 24
    x = torch.randn(tokens, in_features, generator=generator).to(device, torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=generator) * 64).clamp(
        -FP8_MAX, FP8_MAX).to(FP8).to(device)
    scale = (torch.rand(out_features, generator=generator) + 0.5).to(device) / 64
    try:
        got = fp8_linear_scaled_mm(x, weight, scale).float()
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        logger.info("FP8 GEMM (rowwise scaling) unavailable on %s: %s", device,
                    str(error).splitlines()[0] if str(error) else type(error).__name__)
        return False
    want = fp8_linear_torch(x, weight, scale).float()
    error = ((got - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()
    if error > 2e-2:
        logger.warning("FP8 GEMM (rowwise scaling) on %s differs from its twin by %.3g of the "
                       "output's range; not used", device, error)
        return False
    return True

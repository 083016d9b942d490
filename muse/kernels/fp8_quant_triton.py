"""Per-token FP8 activation quantization in one Triton launch: the W8A8 linears' input.

`quantize_fp8_per_token` (its twin, `muse.kernels.fp8_gemm`) runs as six or seven torch kernels
(a cast, abs, amax, clamp, divide, clamp, cast): at batch-1 decode, with a hundred FP8
linears a step, those launches took longer than the GEMMs themselves. Here one program per
row reads it twice (its amax, then the quantized values) and writes the E4M3 row and its
scale, with the twin's rounding: scale = max(amax, 1e-12) / 448 in float32, x / scale rounded
to nearest, clamped to +-448, rounded to nearest even into E4M3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from muse.kernels.fp8_gemm import FP8, FP8_MAX, MIN_AMAX

# Widest slice of a row one loop iteration holds (wider rows take several).
MAX_BLOCK = 4096


@triton.jit
def _quantize_rows_kernel(x_ptr, out_ptr, scale_ptr, static_scale_ptr, K, stride_x, stride_out,
                          STATIC: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
                          MIN_AMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(values))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), MIN_AMAX), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        scaled = tl.minimum(tl.maximum(tl.math.div_rn(values, scale), -FP8_MAX), FP8_MAX)
        tl.store(out_ptr + row * stride_out + cols, scaled.to(out_ptr.dtype.element_ty),
                 mask=cols < K)


def quantize_fp8_per_token_triton(x: torch.Tensor, input_scale: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_fp8_per_token` in one launch: x [M, K] -> (x_fp8 [M, K], scale [M, 1]
    float32); dynamic per-row scales, or the static scalar `input_scale`."""
    rows, width = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, width), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and width:
        block = min(MAX_BLOCK, triton.next_power_of_2(width))
        static = input_scale is not None
        _quantize_rows_kernel[(rows,)](
            x, out, scale, input_scale.float() if static else scale, width, x.stride(0),
            out.stride(0), STATIC=static, BLOCK=block, FP8_MAX=FP8_MAX, MIN_AMAX=MIN_AMAX,
            num_warps=max(1, min(8, block // 512)))
    return out, scale

"""y = x @ W^T for the few rows of a decode step: dispatcher, its twin (`F.linear`), and the
start-up measurement that decides between them.

A decode step multiplies 1-16 activation rows by every projection matrix of every layer, so
each product is a stream of the weight matrix through the GPU with almost no arithmetic.
cuBLAS picks tiles for some of these shapes that leave HBM bandwidth unused (split-K with a
separate reduce kernel for deep matrices, a handful of programs for narrow ones such as a
router's 128 columns). `muse.kernels.linear_triton` instead gives each program a thin slab of
16 output columns across the whole depth.

Which one is faster depends on the shape and the GPU, so it is measured, not assumed: before
the decode CUDA graphs are captured, `tune_decode_linears` replays both over the model's own
weights for every (shape, batch bucket) and records where the Triton kernel wins by a clear
margin. Only those products take it; everything else (CPU, prefill, unmeasured shapes) stays
on `F.linear`.
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("muse")

# The kernel handles up to this many rows (one tl.dot M tile).
SKINNY_MAX_ROWS = 16
# Triton must beat cuBLAS by this factor to be chosen, so near-ties do not flip between runs.
_MARGIN = 0.95

# (rows, out features, in features, dtype) of the products measured faster with Triton, and
# every measurement made in this process (another engine of the same shapes reuses them).
_TRITON_FASTER: set[tuple[int, int, int, torch.dtype]] = set()
_MEASURED: dict[tuple[int, int, int, torch.dtype], dict] = {}


def _key(rows: int, weight: torch.Tensor) -> tuple[int, int, int, torch.dtype]:
    return rows, weight.shape[0], weight.shape[1], weight.dtype


def use_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.is_cuda and bias is None and x.dim() == 2 and weight.stride(1) == 1
            and x.dtype == weight.dtype and _key(x.shape[0], weight) in _TRITON_FASTER)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear, or the skinny Triton kernel where it was measured faster for this shape."""
    if use_skinny(x, weight, bias):
        from muse.kernels.linear_triton import skinny_linear

        return skinny_linear(x, weight)
    return F.linear(x, weight, bias)


class EngineLinear(nn.Linear):
    """nn.Linear whose forward takes `linear`: the same parameters and state-dict names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def use_engine_linears(module: nn.Module) -> None:
    """Make every nn.Linear under `module` an EngineLinear, in place.

    The class of each instance changes and nothing else: parameters, views into fused
    weights, hooks and names stay as they are."""
    for child in module.modules():
        if type(child) is nn.Linear:
            child.__class__ = EngineLinear


def _graph_us(run: Callable[[], object], flush: torch.Tensor, repeats: int = 5) -> float:
    """Median GPU time of `run` replayed as a CUDA graph, from a cold L2 each time (a decode
    step streams gigabytes between two uses of the same matrix)."""
    run()  # compiles, and settles the allocator outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def tune_decode_linears(weights: Iterable[torch.Tensor], row_counts: Iterable[int]
                        ) -> list[dict]:
    """Measure cuBLAS and the Triton kernel on `weights` (CUDA, one row-major matrix per layer
    and projection) for each row count up to SKINNY_MAX_ROWS; from then on `linear` takes the
    Triton kernel where it won. Each candidate runs over all the weights of one shape in a
    graph, as a decode step reads them. Returns the timings, one entry per (shape, rows)."""
    from muse.kernels.linear_triton import skinny_linear

    by_shape: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for weight in weights:
        if weight.is_cuda and weight.dim() == 2 and weight.stride(1) == 1:
            by_shape[(weight.shape[0], weight.shape[1], weight.dtype)].append(weight)
    if not by_shape:
        return []
    device = next(iter(by_shape.values()))[0].device
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    results = []
    for (width, depth, dtype), group in by_shape.items():
        for rows in sorted({r for r in row_counts if 0 < r <= SKINNY_MAX_ROWS}):
            key = _key(rows, group[0])
            if key not in _MEASURED:
                x = torch.randn(rows, depth, dtype=dtype, device=device)
                cublas = _graph_us(lambda: [F.linear(x, w) for w in group], flush)
                triton = _graph_us(lambda: [skinny_linear(x, w) for w in group], flush)
                if triton < _MARGIN * cublas:
                    _TRITON_FASTER.add(key)
                _MEASURED[key] = {"out": width, "in": depth, "rows": rows,
                                  "matrices": len(group), "cublas_us": cublas,
                                  "triton_us": triton, "triton": key in _TRITON_FASTER}
            results.append(_MEASURED[key])
    chosen = [f"{r['out']}x{r['in']}@{r['rows']}" for r in results if r["triton"]]
    logger.info("decode projections on the Triton kernel (out x in @ rows): %s",
                ", ".join(chosen) or "none, cuBLAS was as fast everywhere")
    return results

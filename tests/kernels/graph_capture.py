"""Capturing a kernel call in a CUDA graph for the tests that replay it (GPU only)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output buffer): `step` runs once on a side stream first, so Triton
    compiles outside the capture, then is captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out

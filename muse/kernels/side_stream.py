"""A second CUDA stream for a layer's independent work.

A latent MoE block computes two products of its input that do not depend on each other:
the router's (then the top-k over its logits) and the pooler's (the experts' input). In
order on one stream the small router GEMM and top-k wait for the pooler; on a second stream
they run beside it, and the experts wait for both. `side_stream(device)` forks: the body's
kernels go to the device's side stream, queued after everything the current stream holds,
and the `join` it yields makes the current stream wait for them.

Inside a CUDA graph capture the fork and join become the graph's edges (the side stream joins
the capture by waiting on the capturing stream, and its allocations come from the graph's
pool). Memory stays safe without `record_stream`: a tensor made on one stream and freed after
the join is only handed out again to work queued after a later fork, which waits for
everything before it.

`MUSE_SIDE_STREAM=1` turns it on (see docs/performance.md for what it measured); off, or
without CUDA, the body runs in place and `join` does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

SIDE_STREAM_ON = os.environ.get("MUSE_SIDE_STREAM", "0") == "1"

_streams: dict[int, torch.cuda.Stream] = {}


def _nothing() -> None:
    return None


@contextmanager
def side_stream(device: torch.device) -> Iterator[Callable[[], None]]:
    """Run the body on `device`'s side stream (when there is one: CUDA, switched on); yields
    `join`, which the caller calls before the current stream reads what the body made."""
    if device.type != "cuda" or not SIDE_STREAM_ON:
        yield _nothing
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    side = _streams.get(index)
    if side is None:
        side = _streams[index] = torch.cuda.Stream(device=index)
    main = torch.cuda.current_stream(index)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield lambda: main.wait_stream(side)

"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step.

A batch-1 decode step is some fifteen kernels a layer, most of them a few microseconds long,
and each one normally starts only after the one before it has finished and its writes have
been flushed: the GPU spends a microsecond or two per kernel ramping down and up again.
On Hopper and later a kernel launched with the programmatic-stream-serialization attribute
may start while the kernel before it is still running. It then has to wait
(`griddepcontrol.wait`, `wait_for_inputs`) before it reads anything an earlier kernel wrote
or writes anything at all; work before that wait (a GEMV's weight tile, which no kernel of
the step writes) overlaps the kernel before. A kernel that has passed its own wait lets the
next one be scheduled (`griddepcontrol.launch_dependents`, `let_next_kernel_start`).

The rules every kernel launched this way follows:

* each program waits before its first write and before reading anything but model weights
  (activations, caches, workspaces, the step's metadata and scales may all come from the
  kernel just before); no kernel of a forward pass writes weights;
* each program waits unconditionally, before any early return: then no kernel can finish
  before the one it follows, so the stream's order holds for every later kernel, and
  memory the allocator hands on is not written while an earlier kernel still reads it;
* it lets the next kernel start only after its own wait, so a kernel never runs more than
  one ahead.

Kernels launched without the attribute (torch's, cuBLAS's) are ordinary stream barriers.

`pdl_options(device)` gives the two launch arguments: `PDL` (the kernels' constexpr that
turns the two instructions on) and `launch_pdl` (Triton's launch attribute). Off on CPUs
(Triton's interpreter has no such instructions), on GPUs before Hopper, and with
`MUSE_PDL=0`. A CUDA graph captured from such launches keeps them as programmatic edges.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch."""
    if device.type != "cuda" or os.environ.get("MUSE_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capable(index)


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch keyword arguments for a kernel that takes the `PDL` constexpr."""
    enabled = pdl_enabled(device)
    return {"PDL": enabled, "launch_pdl": enabled}


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait until the kernels before this one have finished and their writes are visible;
    a no-op when the kernel was not launched with PDL."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_start(PDL: tl.constexpr):
    """Allow the next kernel in the stream to be scheduled (it waits for this one to finish
    before touching its outputs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def start_dependent_kernel(PDL: tl.constexpr):
    """The usual opening of a kernel launched with PDL: wait for the kernel before, then let
    the next one be scheduled while this one works."""
    wait_for_inputs(PDL)
    let_next_kernel_start(PDL)

"""Where a batch-1 decode step loses to its roofline, part by part.

Reads a `profile_step.py --phase decode --batch 1 --modes graphs` JSON (best taken with
`MUSE_PDL=0`: with programmatic dependent launch each kernel is timed from its early start,
its wait for the previous one included, so the parts overlap and no longer add up to the
step) and sets each part of the step (the kernels that do one job) beside the bytes that job
must move: its weights, the KV it reads or writes. A part's time above `bytes / bandwidth` is
what it loses; the small parts move almost nothing, so their time is their launches.

`--launch-floor` (GPU only) also measures what one launch costs when it does nothing useful:
a CUDA graph of N dependent one-program kernels (each reads the 4 KB its predecessor wrote),
replayed, divided by N: the floor under every small part's time per launch.

    MUSE_PDL=0 python benchmarks/profile_step.py --shape muse-spark-15b-a2b --phase decode \
        --batch 1 --context 1024 --modes graphs --out profile.json
    python benchmarks/decode_breakdown.py profile.json --launch-floor --out breakdown.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable as `python benchmarks/decode_breakdown.py` from the repository root, uninstalled.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.report import environment, table, write_json  # noqa: E402
from benchmarks.roofline import (H200_MEMORY_BANDWIDTH, ParameterBreakdown,  # noqa: E402
                                 kv_read_bytes, kv_write_bytes)
from benchmarks.shapes import text_config  # noqa: E402
from muse.config import TextConfig  # noqa: E402

# Parts of a step by kernel name: (part, the kernel names' prefixes). cuBLAS GEMMs (the LM
# head at batch 1) have generated names: `nvjet_*`, `sm90_xmma_*`, `cutlass*`, or any other
# with `gemm` in it (`part_of`).
LM_HEAD = "LM head (cuBLAS)"
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("projections (GEMV)", ("_dense_gemv_kernel", "_w4a16_gemv_kernel")),
    ("routed experts", ("_gemm1_swiglu_kernel", "_gemm2_kernel")),
    (LM_HEAD, ("nvjet", "sm90_xmma", "cutlass")),
    ("decode attention", ("_decode_kernel",)),
    ("split-KV combine", ("_split_kv_combine_kernel",)),
    ("MoE combine", ("_moe_combine_kernel",)),
    ("K/V store", ("_write_kv_kernel",)),
    ("add + RMSNorm", ("_rms_norm_kernel",)),
    ("routing (top-k)", ("_route_topk_kernel",)),
    ("q/k norm + RoPE", ("_qk_norm_rope_kernel",)),
)
OTHER = "other (torch ops, copies)"


def part_of(kernel: str) -> str:
    for part, prefixes in PARTS:
        if kernel.startswith(prefixes):
            return part
    return LM_HEAD if "gemm" in kernel.lower() else OTHER


def part_bytes(text: TextConfig, context: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes each part must move in one batch-1 decode step at `context` tokens: the weights
    it streams and the KV it reads or writes; the small parts' activations are left out (a
    few kilobytes a layer)."""
    params = ParameterBreakdown.of(text)
    norms = 2 * text.hidden_size + (2 * text.head_dim if text.qk_norm else 0)
    return {
        "projections (GEMV)": text.num_hidden_layers * (params.per_layer_dense - norms)
        * dtype_bytes,
        "routed experts": text.num_hidden_layers * params.top_k * params.expert * dtype_bytes,
        LM_HEAD: params.vocab_hidden * dtype_bytes,
        "decode attention": kv_read_bytes(text, context, dtype_bytes),
        "K/V store": kv_write_bytes(text, 1, dtype_bytes),
    }


def breakdown(run: dict[str, Any], text: TextConfig, bandwidth: float
              ) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One row per part (launches, measured and roofline microseconds a step) and the step's
    totals, from one profiled run of `profile_step.py`."""
    measured: dict[str, list[float]] = {}
    for kernel in run["kernels"]:
        entry = measured.setdefault(part_of(kernel["name"]), [0.0, 0.0])
        entry[0] += kernel["calls_per_step"]
        entry[1] += kernel["us_per_step"]
    nbytes = part_bytes(text, run["context"])
    rows = []
    for part in [p for p, _ in PARTS] + [OTHER]:
        launches, us = measured.get(part, (0.0, 0.0))
        if not launches and part not in nbytes:
            continue
        roof_us = nbytes.get(part, 0) / bandwidth * 1e6
        rows.append({"part": part, "launches": launches, "us": us,
                     "us_per_launch": us / launches if launches else None,
                     "bytes": nbytes.get(part, 0), "roofline_us": roof_us,
                     "lost_us": us - roof_us,
                     "of_roofline": roof_us / us if us and roof_us else None})
    step_us = run["step_ms"] * 1e3
    kernels_us = run["kernel_ms"] * 1e3
    roof_us = sum(nbytes.values()) / bandwidth * 1e6
    totals = {"step_us": step_us, "kernels_us": kernels_us, "idle_us": step_us - kernels_us,
              "roofline_us": roof_us, "target_60_us": roof_us / 0.6,
              "of_roofline": roof_us / step_us}
    return rows, totals


def launch_floor(count: int = 512, repeats: int = 20) -> dict[str, float]:
    """Microseconds per launch of a chain of dependent one-program kernels in a CUDA graph."""
    import triton
    import triton.language as tl

    @triton.jit
    def _pass_on(src, dst, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(dst + offsets, tl.load(src + offsets) + 1.0)

    buffers = [torch.zeros(1024, device="cuda") for _ in range(2)]

    def chain() -> None:
        for i in range(count):
            _pass_on[(1,)](buffers[i % 2], buffers[(i + 1) % 2], N=1024)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {"launches": count, "us_per_launch": start.elapsed_time(end) * 1e3
            / (repeats * count)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", help="JSON written by profile_step.py (decode, batch 1)")
    parser.add_argument("--mem-bandwidth", type=float, default=H200_MEMORY_BANDWIDTH,
                        help="bytes/s (default: measured H200 copy bandwidth)")
    parser.add_argument("--launch-floor", action="store_true",
                        help="also time a chain of empty dependent launches (GPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    runs = [r for r in json.loads(Path(args.profile).read_text())["runs"]
            if r["phase"] == "decode" and r["batch"] == 1 and not r["eager"]]
    if not runs:
        raise SystemExit(f"{args.profile}: no batch-1 decode run with graphs")
    results = []
    for run in runs:
        text = text_config(run["shape"])
        rows, totals = breakdown(run, text, args.mem_bandwidth)
        print(f"\n{run['shape']}, batch 1, context {run['context']}: step "
              f"{totals['step_us']:.0f} us ({totals['of_roofline']:.0%} of the "
              f"{totals['roofline_us']:.0f} us roofline; 60% needs "
              f"{totals['target_60_us']:.0f} us), kernels {totals['kernels_us']:.0f} us, "
              f"GPU idle {totals['idle_us']:.0f} us")
        print(table(["part", "launches", "us", "us/launch", "MB", "roofline us", "lost us"],
                    [[r["part"], f"{r['launches']:.0f}", f"{r['us']:.0f}",
                      "" if r["us_per_launch"] is None else f"{r['us_per_launch']:.1f}",
                      f"{r['bytes'] / 1e6:.1f}", f"{r['roofline_us']:.0f}",
                      f"{r['lost_us']:.0f}"] for r in rows]))
        results.append({"shape": run["shape"], "context": run["context"], "parts": rows,
                        "totals": totals})
    floor = launch_floor() if args.launch_floor else None
    if floor:
        print(f"\nlaunch floor: {floor['us_per_launch']:.2f} us per dependent launch "
              f"({floor['launches']} one-program kernels in a CUDA graph)")
    if args.out:
        device = torch.device("cuda" if floor else "cpu")
        write_json(args.out, {"environment": environment(device), "profile": args.profile,
                              "memory_bandwidth_Bps": args.mem_bandwidth,
                              "launch_floor": floor, "results": results})


if __name__ == "__main__":
    main()

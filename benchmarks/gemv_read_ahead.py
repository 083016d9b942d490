"""Batch-1 projections whose weights are read into L2 ahead of them, while a chain of small
kernels runs: can such a read hide a projection's HBM stream behind the small kernels of a
decode step (norms, routing, the combines: about 16 us a 15B layer moving almost nothing)?

Per projection of each `--shapes` preset (the cases of `decode_gemv.py`), three timings, each
a chain of `--chain` one-program dependent kernels followed by the one-row GEMV, over weight
copies that outgrow L2 (timed as `decode_gemv.py` times, one CUDA graph):

- `cold`: the chain, then the GEMV reading its weights from HBM;
- `read_ahead`: a kernel on a second stream reads the weights (evict-last loads, the sums
  discarded) while the chain runs; the GEMV waits for both;
- `in_l2`: the chain, then the GEMV over one copy call after call (its weights in L2: the
  bound `read_ahead` can reach).

    python benchmarks/gemv_read_ahead.py --out results/gemv-read-ahead.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.decode_gemv import DTYPE, SHAPES, add_shapes_argument, time_cases  # noqa: E402
from benchmarks.report import environment, table  # noqa: E402
from benchmarks.report import fmt as number  # noqa: E402
from benchmarks.w4a16_gemm import (FLUSH_BYTES, copies_for, random_dense,  # noqa: E402
                                   time_per_call)

READ_BLOCK = 4096  # elements a program reads a step


@triton.jit
def _read_ahead_kernel(w_ptr, sink_ptr, numel, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Reads STEPS x BLOCK elements of w with evict-last loads, so they stay in L2 for the
    kernel that needs them next; the sum goes to one scratch float per program only so the
    loads are not removed."""
    offs = tl.program_id(0) * STEPS * BLOCK + tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float32)
    for step in range(STEPS):
        at = offs + step * BLOCK
        total += tl.load(w_ptr + at, mask=at < numel, other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(total, 0))


@triton.jit
def _tick_kernel(x_ptr):
    """One program adding one to one float: a stand-in for a decode step's small kernels,
    each depending on the one before."""
    tl.store(x_ptr, tl.load(x_ptr) + 1.0)


def read_ahead(weight: torch.Tensor, sink: torch.Tensor, programs: int) -> None:
    numel = weight.numel()
    steps = triton.cdiv(numel, programs * READ_BLOCK)
    _read_ahead_kernel[(programs,)](weight, sink, numel, STEPS=steps, BLOCK=READ_BLOCK,
                                    num_warps=8)


def chain(counter: torch.Tensor, length: int) -> None:
    for _ in range(length):
        _tick_kernel[(1,)](counter, num_warps=1)


def run_case(shape: str, case, args: argparse.Namespace, device: torch.device,
             time=time_per_call) -> dict:
    from muse.kernels.gemv_triton import choose_dense_gemv_tiles, dense_gemv

    gen = torch.Generator(device=device).manual_seed(args.seed)
    out, inp = case.out_features, case.in_features
    num_bytes = 2 * out * inp
    x = torch.randn(inp, dtype=DTYPE, device=device, generator=gen)
    weights = [random_dense((out, inp), device, gen)
               for _ in range(copies_for(num_bytes, args.flush_bytes))]
    tiles = choose_dense_gemv_tiles(out, inp)
    counter = torch.zeros(1, device=device)
    programs = args.read_programs or (torch.cuda.get_device_properties(device)
                                      .multi_processor_count if device.type == "cuda" else 4)
    sink = torch.empty(programs, device=device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def cold(w: torch.Tensor) -> None:
        chain(counter, args.chain)
        dense_gemv(x, w, tiles=tiles)

    def ahead(w: torch.Tensor) -> None:
        if side is None:  # CPU: the same kernels in order
            read_ahead(w, sink, programs)
            cold(w)
            return
        main = torch.cuda.current_stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            read_ahead(w, sink, programs)
        chain(counter, args.chain)
        main.wait_stream(side)
        dense_gemv(x, w, tiles=tiles)

    figures = {
        "cold_us": time([lambda w=w: cold(w) for w in weights], args.repeats),
        "read_ahead_us": time([lambda w=w: ahead(w) for w in weights], args.repeats),
        "in_l2_us": time([lambda: cold(weights[0])] * len(weights), args.repeats),
        "chain_us": time([lambda: chain(counter, args.chain)] * len(weights), args.repeats),
    }
    return {"shape": shape, "name": case.name, "out": out, "in": inp, "bytes": num_bytes,
            "chain": args.chain, "read_programs": programs, **figures}


def report(rows: list[dict]) -> str:
    headers = ["shape", "case", "MB", "chain us", "chain + GEMV cold", "read ahead",
               "weights in L2", "of the gap closed"]
    lines = []
    for row in rows:
        gap = row["cold_us"] - row["in_l2_us"]
        closed = (row["cold_us"] - row["read_ahead_us"]) / gap if gap > 0 else float("nan")
        lines.append([row["shape"], row["name"], number(row["bytes"] / 1e6, 1),
                      number(row["chain_us"], 2), number(row["cold_us"], 2),
                      number(row["read_ahead_us"], 2), number(row["in_l2_us"], 2),
                      f"{closed:.0%}"])
    return table(headers, lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shapes_argument(parser, SHAPES[:2])
    parser.add_argument("--chain", type=int, default=8,
                        help="small dependent kernels before each GEMV")
    parser.add_argument("--read-programs", type=int, default=0,
                        help="programs of the read-ahead kernel (default: one an SM)")
    parser.add_argument("--repeats", type=int, default=20, help="graph replays timed")
    parser.add_argument("--flush-bytes", type=int, default=FLUSH_BYTES,
                        help="bytes the copies of a weight add up to (beyond L2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gemv_read_ahead.py times CUDA kernels and needs a GPU")
    device = torch.device("cuda")
    record = {"benchmark": "gemv_read_ahead",
              "config": {key: value for key, value in vars(args).items() if key != "out"},
              "environment": environment(device), "results": []}
    return time_cases(record, run_case, args, device, report)


if __name__ == "__main__":
    main()

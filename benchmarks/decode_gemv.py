"""Batch-1 decode projections: cuBLAS (`F.linear`) against the one-row GEMV
(`muse.kernels.gemv_triton.dense_gemv`), for every unquantized linear layer of a decoder layer
of each shape, on the GPU.

One activation row, bf16 random weights. Timing as in `benchmarks/w4a16_gemm.py`: a variant's
calls over enough copies of the weight to outgrow the L2 cache are captured in one CUDA graph
and replayed; the figure is the median time per call, and the bandwidth share is the weight's
bytes over that time against the H200's measured copy bandwidth (`benchmarks/roofline.py`).
The GEMV is also timed over one copy, call after call, its weights then in L2: what a
projection would take had its weights been fetched ahead of it.
`--sweep-tiles` also times candidate GEMV tiles (`GemvTiles`), each with the split-K
`split_for` gives it and without.

    python benchmarks/decode_gemv.py --sweep-tiles --out results/decode-gemv.json
    python benchmarks/decode_gemv.py --dry-run    # the cases and their bytes, no GPU needed
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.options import parse_list  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from benchmarks.report import fmt as number  # noqa: E402
from benchmarks.roofline import H200_MEMORY_BANDWIDTH  # noqa: E402
from benchmarks.w4a16_gemm import (DenseCase, add_timing_arguments, copies_for,  # noqa: E402
                                   dense_cases, random_dense, time_per_call, timed)
from muse.presets import PRESETS, get_preset  # noqa: E402

DTYPE = torch.bfloat16
SHAPES = ["muse-spark-15b-a2b", "qwen3-30b-a3b-shape", "qwen3-0.6b-shape"]
# Candidate (block_n, block_k, num_warps, num_stages) for --sweep-tiles: few rows a program
# with the whole K (many programs, no split) through 16-row slabs split along K.
SWEEP = [(16, 512, 4, 1), (16, 256, 4, 1), (32, 256, 4, 1), (16, 1024, 8, 1), (8, 1024, 4, 2),
         (8, 1024, 8, 1), (8, 2048, 8, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (2, 2048, 4, 1),
         (4, 512, 2, 1), (16, 1024, 4, 1)]


def cases_of(shape: str) -> list[DenseCase]:
    """The linear layers of one decoder layer, the MoE router included."""
    text = get_preset(shape).text_config
    cases = dense_cases(text)
    if text.num_experts:
        cases.append(DenseCase("moe.gate", text.num_experts, text.hidden_size))
    return cases


def sweep_tiles(out: int, inp: int) -> list:
    from muse.kernels.gemv_triton import GemvTiles, split_for

    tiles = []
    for n, k, warps, stages in SWEEP:
        split = split_for(math.ceil(out / n), math.ceil(inp / k))
        tiles += [GemvTiles(n, k, warps, split, stages)] + (
            [GemvTiles(n, k, warps, 1, stages)] if split > 1 else [])
    return tiles


def run_case(shape: str, case: DenseCase, args: argparse.Namespace,
             device: torch.device) -> dict:
    from muse.kernels.gemv_triton import choose_dense_gemv_tiles, dense_gemv

    gen = torch.Generator(device=device).manual_seed(args.seed)
    out, inp = case.out_features, case.in_features
    num_bytes = 2 * out * inp
    x = torch.randn(1, inp, dtype=DTYPE, device=device, generator=gen)
    weights = [random_dense((out, inp), device, gen)
               for _ in range(copies_for(num_bytes, args.flush_bytes))]
    roofline_us = num_bytes / H200_MEMORY_BANDWIDTH * 1e6
    cublas = time_per_call([lambda w=w: F.linear(x, w) for w in weights], args.repeats)
    tiles = choose_dense_gemv_tiles(out, inp)
    gemv = time_per_call([lambda w=w: dense_gemv(x[0], w, tiles=tiles) for w in weights],
                         args.repeats)
    # The same GEMV over one copy, call after call: its weights stay in L2 (every decode
    # projection here is well under the 50 MB of an H100's or H200's L2). What a projection
    # would take if its weights had been fetched ahead, while the small kernels before it ran.
    gemv_l2 = time_per_call([lambda: dense_gemv(x[0], weights[0], tiles=tiles)] * len(weights),
                            args.repeats)
    record = {"shape": shape, "name": case.name, "out": out, "in": inp, "bytes": num_bytes,
              "roofline_us": roofline_us, "cublas_us": cublas, "gemv_us": gemv,
              "gemv_l2_us": gemv_l2, "gemv_tiles": vars(tiles), "speedup": cublas / gemv}
    if args.sweep_tiles:
        record["sweep_us"] = {
            str(list(vars(t).values())): timed(
                [lambda w=w, t=t: dense_gemv(x[0], w, tiles=t) for w in weights], args.repeats)
            for t in sweep_tiles(out, inp)}
    return record


def report(rows: list[dict]) -> str:
    headers = ["shape", "case", "out x in", "roofline us", "cuBLAS us", "of bw", "GEMV us",
               "of bw", "speedup", "GEMV, weights in L2 us", "best swept us"]
    lines = []
    for row in rows:
        swept = [us for us in row.get("sweep_us", {}).values() if us]
        lines.append([row["shape"], row["name"], f"{row['out']}x{row['in']}",
                      number(row["roofline_us"], 2), number(row["cublas_us"], 2),
                      f"{row['roofline_us'] / row['cublas_us']:.0%}",
                      number(row["gemv_us"], 2), f"{row['roofline_us'] / row['gemv_us']:.0%}",
                      number(row["speedup"], 2) + "x", number(row["gemv_l2_us"], 2),
                      number(min(swept), 2) if swept else "-"])
    return table(headers, lines)


def _presets(text: str) -> list[str]:
    names = parse_list(text, str)
    unknown = [name for name in names if name not in PRESETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown preset {unknown[0]!r}")
    return names


def add_shapes_argument(parser: argparse.ArgumentParser, default: list[str]) -> None:
    """`--shapes`: comma-separated presets whose projections are timed."""
    parser.add_argument("--shapes", default=",".join(default), type=_presets)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shapes_argument(parser, SHAPES)
    add_timing_arguments(parser, "GEMV tiles")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    config = {key: value for key, value in vars(args).items() if key != "out"}
    plan = [(shape, case) for shape in args.shapes for case in cases_of(shape)]
    if args.dry_run:
        cases = [{"shape": shape, "name": case.name, "out": case.out_features,
                  "in": case.in_features, "bytes": 2 * case.out_features * case.in_features}
                 for shape, case in plan]
        for row in cases:
            print(f"  {row['shape']:22s} {row['name']:22s} {row['out']:6d} x {row['in']:6d}"
                  f"  {row['bytes']:>10,d} bytes")
        record = {"benchmark": "decode_gemv", "dry_run": True, "config": config,
                  "environment": environment(torch.device("cpu")), "cases": cases}
        write_json(args.out, record)
        return record
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_gemv.py times CUDA kernels and needs a GPU; "
                         "--dry-run lists the cases without one")
    device = torch.device("cuda")
    record = {"benchmark": "decode_gemv", "config": config, "environment": environment(device),
              "results": []}
    print(f"decode_gemv on {record['environment']['gpu']}, commit "
          f"{record['environment']['git_commit']}")
    return time_cases(record, run_case, args, device, report)


def time_cases(record: dict, run, args: argparse.Namespace, device: torch.device,
               report) -> dict:
    """`run(shape, case, args, device)` for every projection of every `args.shapes` preset,
    each row added to `record["results"]` and the JSON written after it (a run stopped half-way
    keeps what it measured), then `report`'s table printed."""
    for shape in args.shapes:
        for case in cases_of(shape):
            record["results"].append(run(shape, case, args, device))
            write_json(args.out, record)
    print(report(record["results"]))
    return record


if __name__ == "__main__":
    main()

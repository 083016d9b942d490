"""How much faster are decode GEMMs on FP4 weights? bf16 against W4A16 (NVFP4, MXFP4) at the
decode shapes of a preset, on the GPU.

Two kinds of case (`--cases`), with random weights:

* `dense`: each linear layer of a decoder layer (fused q/k/v, o_proj, the MoE's pooler and
  unpooler, a dense or shared MLP where the preset has one) at `--rows` activation rows
  (1, 8, 64, 256): `F.linear` on the bf16 weight against `w4a16_linear_triton` on the packed
  one;
* `moe`: the routed experts (`moe_triton.fused_experts`: E experts of gate_up [2I, L] and
  down [L, I]) for `--tokens` tokens (1, 8, 64) with random top-k routing: bf16 experts
  against FP4 experts.

Timing: a variant's calls are captured in one CUDA graph and replayed `--repeats` times; the
figure is the median time per call. Each call must read its weights from HBM, as a layer of
the model does: dense cases cycle through enough copies of the weight to outgrow the L2 cache
(`--flush-bytes`), MoE cases through different random routings over one set of experts.
Bytes per call: the weights it reads (for the MoE, the distinct experts its routing picks),
with their scales and row factors, plus the activations read and the output written; GB/s is
bytes / time, and speedup is the bf16 time over the FP4 time. `--sweep-tiles` also times
candidate tiles of the dense kernel (`LinearTiles`) for each case, and at one row those of
the GEMV that one row takes (`GemvTiles`).

    python benchmarks/w4a16_gemm.py --out results/w4a16-gemm-muse-spark-15b-a2b.json
    python benchmarks/w4a16_gemm.py --dry-run   # the cases and their bytes, no GPU needed
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.options import parse_list  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from benchmarks.report import fmt as number  # noqa: E402
from muse.config import TextConfig  # noqa: E402
from muse.kernels.w4a16 import SCALE_BLOCK, Fp4Weight  # noqa: E402
from muse.presets import PRESETS, get_preset  # noqa: E402

DTYPE = torch.bfloat16
FORMATS = tuple(SCALE_BLOCK)
# Bytes each variant's copies of a dense weight add up to: several times an H200's L2 (50 MB).
FLUSH_BYTES = 256 << 20
MAX_COPIES = 256
# Routings captured per MoE variant.
MOE_ROUTINGS = 16

# Candidate (block_n, block_k, num_warps, num_stages) of the dense kernel for --sweep-tiles;
# block_m follows the rows (16 up to 16 rows, the rows' power of two up to 64, then 128).
SWEEP_DECODE = [(16, 256, 1, 4), (16, 128, 1, 4), (16, 512, 1, 3), (32, 256, 2, 4),
                (32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3)]
# Candidate (block_n, block_k, num_warps) of the one-row GEMV (`w4a16_gemv`, which one row
# takes); each with the split-K `choose_gemv_tiles` would give it.
SWEEP_GEMV = [(32, 256, 4), (16, 256, 2), (64, 256, 4), (32, 512, 4), (64, 128, 4),
              (128, 128, 8), (16, 512, 1)]
SWEEP_MEDIUM = [(64, 128, 4, 4), (32, 128, 4, 4), (128, 64, 4, 3), (64, 64, 4, 6)]
SWEEP_LARGE = [(128, 64, 8, 3), (64, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3)]


@dataclass(frozen=True)
class DenseCase:
    name: str
    out_features: int
    in_features: int


@dataclass(frozen=True)
class MoECase:
    num_experts: int
    top_k: int
    latent: int
    inter: int


def dense_cases(text: TextConfig) -> list[DenseCase]:
    """The linear layers of one decoder layer, as [out, in]."""
    hidden, head_dim = text.hidden_size, text.head_dim
    heads, kv_heads = text.num_attention_heads, text.num_key_value_heads
    cases = [DenseCase("qkv_proj", (heads + 2 * kv_heads) * head_dim, hidden),
             DenseCase("o_proj", hidden, heads * head_dim)]
    if text.num_experts and text.moe_latent_size:
        cases += [DenseCase("moe.pooler", text.moe_latent_size, hidden),
                  DenseCase("moe.unpooler", hidden, text.moe_latent_size)]
    mlp = (text.intermediate_size if not text.num_experts
           else text.moe_intermediate_size * text.num_shared_experts)
    if mlp:
        prefix = "mlp" if not text.num_experts else "shared_expert"
        cases += [DenseCase(f"{prefix}.gate_up_proj", 2 * mlp, hidden),
                  DenseCase(f"{prefix}.down_proj", hidden, mlp)]
    return cases


def moe_case(text: TextConfig) -> MoECase | None:
    if not text.num_experts:
        return None
    return MoECase(text.num_experts, text.num_experts_per_tok,
                   text.moe_latent_size or text.hidden_size, text.moe_intermediate_size)


def weight_bytes(fmt: str, out_features: int, in_features: int, experts: int = 1) -> int:
    """Bytes of a weight [experts, out, in]: bf16, or packed FP4 with one scale byte per
    block and (NVFP4) a float32 factor per row."""
    count = experts * out_features * in_features
    if fmt == "bf16":
        return 2 * count
    factors = 4 * experts * out_features if fmt == "nvfp4" else 0
    return count // 2 + count // SCALE_BLOCK[fmt] + factors


def random_fp4(fmt: str, shape: tuple[int, ...], device: torch.device,
               gen: torch.Generator) -> Fp4Weight:
    """Random packed values; scales and factors of the magnitudes a real layer has."""
    *lead, out, inp = shape
    packed = torch.randint(0, 256, (*lead, out, inp // 2), dtype=torch.uint8, device=device,
                           generator=gen)
    blocks = (*lead, out, inp // SCALE_BLOCK[fmt])
    if fmt == "nvfp4":
        scales = torch.empty(blocks, device=device).uniform_(16, 448, generator=gen)
        factor = torch.full((*lead, out, 1), 0.02 / (6 * 448), device=device)
        return Fp4Weight(fmt, packed, scales.to(torch.float8_e4m3fn), factor)
    scales = torch.randint(118, 123, blocks, dtype=torch.uint8, device=device, generator=gen)
    return Fp4Weight(fmt, packed, scales)


def random_dense(shape: tuple[int, ...], device: torch.device,
                 gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, dtype=DTYPE, device=device, generator=gen) * shape[-1] ** -0.5


def time_per_call(calls: list[Callable[[], object]], repeats: int) -> float:
    """Median microseconds per call, the calls captured in one CUDA graph (compiled and warmed
    up on a side stream first, as a capture needs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def timed(calls: list[Callable[[], object]], repeats: int) -> float | None:
    """time_per_call, or None where a candidate tile does not compile or fit."""
    try:
        return time_per_call(calls, repeats)
    except Exception as error:  # noqa: BLE001 - a tile that does not fit is an answer too
        print(f"    tiles failed: {type(error).__name__}: {str(error)[:100]}")
        return None


def _figures(us: float | None, num_bytes: int, baseline_us: float | None = None) -> dict:
    row = {"us": us, "bytes": num_bytes,
           "GBps": num_bytes / us / 1e3 if us else None}
    if baseline_us is not None:
        row["speedup"] = baseline_us / us if us else None
    return row


def copies_for(num_bytes: int, flush_bytes: int) -> int:
    return max(2, min(MAX_COPIES, math.ceil(flush_bytes / num_bytes)))


def _sweep(rows: int, shape: tuple[int, int]) -> list:
    """The candidate tiles at this many rows, each with the split-K `choose_tiles` would give
    it (and without, where that differs)."""
    from muse.kernels.w4a16_triton import LinearTiles, split_for

    if rows > 64:
        candidates = [LinearTiles(128, *tile) for tile in SWEEP_LARGE]
    else:
        block_m = max(16, 1 << (rows - 1).bit_length())
        candidates = [LinearTiles(block_m, *tile)
                      for tile in (SWEEP_DECODE if rows <= 16 else SWEEP_MEDIUM)]
    out, inp = shape
    tiles = []
    for tile in candidates:
        programs = math.ceil(rows / tile.block_m) * math.ceil(out / tile.block_n)
        split = split_for(programs, math.ceil(inp / tile.block_k))
        tiles += [dataclasses.replace(tile, split_k=split)] + ([tile] if split > 1 else [])
    return tiles


def _sweep_gemv(shape: tuple[int, int]) -> list:
    from muse.kernels.w4a16_triton import GemvTiles, split_for

    out, inp = shape
    return [GemvTiles(n, k, warps, split_for(math.ceil(out / n), math.ceil(inp / k)))
            for n, k, warps in SWEEP_GEMV]


def run_dense(case: DenseCase, rows: int, formats: list[str], args: argparse.Namespace,
              device: torch.device) -> dict:
    from muse.kernels.w4a16_triton import choose_gemv_tiles, choose_tiles, w4a16_linear

    gen = torch.Generator(device=device).manual_seed(args.seed)
    shape = (case.out_features, case.in_features)
    activations = 2 * rows * (case.in_features + case.out_features)
    x = torch.randn(rows, case.in_features, dtype=DTYPE, device=device, generator=gen)
    record = {"kind": "dense", "name": case.name, "rows": rows, "shape": list(shape),
              "tiles": vars(choose_tiles(rows, *shape) if rows > 1
                            else choose_gemv_tiles(*shape, 16))}
    dense_bytes = weight_bytes("bf16", *shape)
    weights = [random_dense(shape, device, gen)
               for _ in range(copies_for(dense_bytes, args.flush_bytes))]
    baseline = time_per_call([lambda w=w: F.linear(x, w) for w in weights], args.repeats)
    record["bf16"] = _figures(baseline, dense_bytes + activations)
    del weights
    for fmt in formats:
        num_bytes = weight_bytes(fmt, *shape)
        fp4 = [random_fp4(fmt, shape, device, gen)
               for _ in range(copies_for(num_bytes, args.flush_bytes))]
        us = time_per_call([lambda w=w: w4a16_linear(x, w) for w in fp4], args.repeats)
        record[fmt] = _figures(us, num_bytes + activations, baseline)
        if args.sweep_tiles:
            record[fmt]["sweep_us"] = {
                str(list(vars(tiles).values())): timed(
                    [lambda w=w, t=tiles: w4a16_linear(x, w, tiles=t) for w in fp4],
                    args.repeats)
                for tiles in _sweep(rows, shape)}
            if rows == 1:
                from muse.kernels.w4a16_triton import w4a16_gemv

                record[fmt]["sweep_gemv_us"] = {
                    str(list(vars(tiles).values())): timed(
                        [lambda w=w, t=tiles: w4a16_gemv(x[0], w, tiles=t) for w in fp4],
                        args.repeats)
                    for tiles in _sweep_gemv(shape)}
        del fp4
    return record


def run_moe(case: MoECase, tokens: int, formats: list[str], args: argparse.Namespace,
            device: torch.device) -> dict:
    from muse.kernels.moe_triton import fused_experts, use_one_pair_per_block

    gen = torch.Generator(device=device).manual_seed(args.seed)
    experts, latent, inter = case.num_experts, case.latent, case.inter
    x = torch.randn(tokens, latent, dtype=DTYPE, device=device, generator=gen)
    norm = torch.ones(experts, latent, dtype=DTYPE, device=device)
    routings = []
    for _ in range(args.moe_routings):
        logits = torch.rand(tokens, experts, device=device, generator=gen)
        weights, ids = logits.softmax(-1).topk(case.top_k)
        routings.append((weights.contiguous(), ids.contiguous()))
    # The distinct experts a call reads, averaged over its routings.
    distinct = statistics.mean(ids.unique().numel() for _, ids in routings)
    activations = 2 * 2 * tokens * latent
    record = {"kind": "moe", "name": "experts", "tokens": tokens, "distinct_experts": distinct,
              "one_pair_per_block": use_one_pair_per_block(tokens * case.top_k, experts),
              "shape": vars(case)}

    def per_call(fmt: str) -> int:
        per_expert = (weight_bytes(fmt, 2 * inter, latent) + weight_bytes(fmt, latent, inter))
        return round(distinct * per_expert) + activations

    def calls(gate_up, down) -> list[Callable[[], object]]:
        return [lambda w=w, i=i: fused_experts(x, w, i, gate_up, down, norm, 1e-6)
                for w, i in routings]

    gate_up = random_dense((experts, 2 * inter, latent), device, gen)
    down = random_dense((experts, latent, inter), device, gen)
    baseline = time_per_call(calls(gate_up, down), args.repeats)
    record["bf16"] = _figures(baseline, per_call("bf16"))
    del gate_up, down
    for fmt in formats:
        gate_up = random_fp4(fmt, (experts, 2 * inter, latent), device, gen)
        down = random_fp4(fmt, (experts, latent, inter), device, gen)
        record[fmt] = _figures(time_per_call(calls(gate_up, down), args.repeats),
                               per_call(fmt), baseline)
    return record


def plan(args: argparse.Namespace) -> list[tuple[str, object, int]]:
    """(kind, case, rows or tokens) of every case asked for."""
    text = get_preset(args.shape).text_config
    cases = []
    if "dense" in args.cases:
        cases += [("dense", case, rows) for case in dense_cases(text) for rows in args.rows]
    moe = moe_case(text)
    if "moe" in args.cases and moe is not None:
        cases += [("moe", moe, tokens) for tokens in args.tokens]
    return cases


def dry_run_rows(cases: list[tuple[str, object, int]], formats: list[str]) -> list[dict]:
    """The cases and the weight bytes of each variant (`weight_bytes`; for the MoE, those of
    one expert, `expert_bytes`), untimed."""
    rows = []
    for kind, case, size in cases:
        if kind == "dense":
            row = {"kind": kind, "name": case.name, "rows": size,
                   "shape": [case.out_features, case.in_features]}
            shapes = [(case.out_features, case.in_features)]
        else:
            row = {"kind": kind, "name": "experts", "tokens": size, "shape": vars(case)}
            shapes = [(2 * case.inter, case.latent), (case.latent, case.inter)]
        key = "weight_bytes" if kind == "dense" else "expert_bytes"
        row[key] = {fmt: sum(weight_bytes(fmt, *s) for s in shapes)
                    for fmt in ("bf16", *formats)}
        rows.append(row)
    return rows


def report(rows: list[dict], formats: list[str]) -> str:
    headers = ["case", "M", "bf16 us", "bf16 GB/s"]
    for fmt in formats:
        headers += [f"{fmt} us", f"{fmt} GB/s", "speedup"]
    lines = []
    for row in rows:
        size = row.get("rows", row.get("tokens"))
        line = [row["name"], str(size), number(row["bf16"]["us"], 1),
                number(row["bf16"]["GBps"])]
        for name in formats:
            figures = row[name]
            line += [number(figures["us"], 1), number(figures["GBps"]),
                     number(figures["speedup"], 2) + "x"]
        lines.append(line)
    return table(headers, lines)


def add_timing_arguments(parser: argparse.ArgumentParser, swept: str) -> None:
    """The options of a benchmark timed as this one times (`time_per_call` over weight copies
    that outgrow L2), shared with `decode_gemv.py`; `swept`: what --sweep-tiles times."""
    parser.add_argument("--repeats", type=int, default=20, help="graph replays timed")
    parser.add_argument("--flush-bytes", type=int, default=FLUSH_BYTES,
                        help="bytes the copies of a weight add up to (beyond L2)")
    parser.add_argument("--sweep-tiles", action="store_true", help=f"also time candidate {swept}")
    parser.add_argument("--dry-run", action="store_true",
                        help="list the cases and their bytes without timing (no GPU needed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the results")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS))
    parser.add_argument("--cases", default="dense,moe", type=lambda s: parse_list(s, str),
                        help="dense and / or moe")
    parser.add_argument("--rows", default="1,8,64,256", type=parse_list,
                        help="activation rows of the dense cases")
    parser.add_argument("--tokens", default="1,8,64", type=parse_list,
                        help="tokens of the MoE cases (each routed to top-k experts)")
    parser.add_argument("--formats", default=",".join(FORMATS),
                        type=lambda s: parse_list(s, str))
    parser.add_argument("--moe-routings", type=int, default=MOE_ROUTINGS,
                        help="distinct routings captured per MoE variant")
    add_timing_arguments(parser, "tiles of the dense kernel")
    args = parser.parse_args(argv)
    for name in args.formats:
        if name not in FORMATS:
            parser.error(f"--formats: {name!r} is not one of {', '.join(FORMATS)}")
    for name in args.cases:
        if name not in ("dense", "moe"):
            parser.error(f"--cases: {name!r} is not one of dense, moe")
    if min(args.rows + args.tokens, default=1) < 1:
        parser.error("--rows and --tokens must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    cases = plan(args)
    config = {key: value for key, value in vars(args).items() if key != "out"}
    if args.dry_run:
        record = {"benchmark": "w4a16_gemm", "dry_run": True, "config": config,
                  "environment": environment(torch.device("cpu")),
                  "cases": dry_run_rows(cases, args.formats)}
        for row in record["cases"]:
            size = row.get("rows", row.get("tokens"))
            key = "weight_bytes" if row["kind"] == "dense" else "expert_bytes"
            print(f"  {row['kind']:5s} {row['name']:24s} {size:5d}  {key} {row[key]}")
        write_json(args.out, record)
        return record
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/w4a16_gemm.py times CUDA kernels and needs a GPU "
                         "(torch.cuda.is_available() is False); --dry-run lists the cases "
                         "and their bytes without one")
    device = torch.device("cuda")
    record = {"benchmark": "w4a16_gemm", "config": config, "environment": environment(device),
              "results": []}
    env = record["environment"]
    print(f"w4a16_gemm: {args.shape} on {env['gpu']}, commit {env['git_commit']}")
    for kind, case, size in cases:
        run = run_dense if kind == "dense" else run_moe
        record["results"].append(run(case, size, args.formats, args, device))
        write_json(args.out, record)  # a run stopped half-way keeps what it measured
    print(report(record["results"], args.formats))
    return record


if __name__ == "__main__":
    main()

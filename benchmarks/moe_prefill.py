"""The routed experts of a prefill chunk: the Triton tiles against the grouped GEMMs.

For each MoE shape the benchmarks model and each chunk size, times `fused_experts` with the
grouped-GEMM path (`torch._grouped_mm`, taken from GROUPED_MM_MIN_PAIRS pairs on Hopper) and
with the Triton tiles (`tiles=` forces them), on random bf16 data with uniform routing, and
checks both against the torch twin. Timed by `triton.testing.do_bench` (median of repeated
launches, L2 flushed between them); TFLOP/s counts the two products' multiply-adds.

    python benchmarks/moe_prefill.py --out moe-prefill.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import environment, write_json  # noqa: E402

# (shape, experts, top-k, latent or hidden width, expert width), as in tune_kernels.py.
SHAPES = (("muse-spark-15b-a2b", 256, 8, 1024, 640), ("qwen3-30b-a3b-shape", 128, 8, 2048, 768))


def measure(shape: tuple, tokens: int, device: torch.device) -> dict:
    import triton.testing

    from muse.kernels.moe import fused_experts_torch
    from muse.kernels.moe_triton import choose_tiles, fused_experts, use_grouped_mm

    name, experts, top_k, latent, inter = shape
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, latent, dtype=torch.bfloat16, device=device, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, latent, dtype=torch.bfloat16, device=device,
                          generator=gen) * latent ** -0.5
    down = torch.randn(experts, latent, inter, dtype=torch.bfloat16, device=device,
                       generator=gen) * inter ** -0.5
    norm = 1 + 0.1 * torch.randn(experts, latent, dtype=torch.bfloat16, device=device,
                                 generator=gen)
    weights, ids = torch.rand(tokens, experts, device=device, generator=gen).softmax(-1).topk(top_k)
    pairs = tokens * top_k
    tiles = choose_tiles(pairs, experts)
    paths = {"triton": lambda: fused_experts(x, weights, ids, gate_up, down, norm, 1e-6,
                                             tiles=tiles),
             "grouped": lambda: fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)}
    twin = fused_experts_torch(x, weights, ids, gate_up, down, norm, 1e-6).float()
    flops = 2 * pairs * (2 * inter * latent + latent * inter)
    row = {"shape": name, "tokens": tokens, "pairs": pairs,
           "grouped_taken": use_grouped_mm(x, gate_up, down, pairs, None)}
    for path, fn in paths.items():
        error = (fn().float() - twin).abs().max().item() / twin.abs().max().item()
        us = triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3
        row[path] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                     "max_error_of_twin_scale": error}
    row["speedup"] = round(row["triton"]["us"] / row["grouped"]["us"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1024,4096,8192",
                        help="chunk sizes, comma-separated")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for shape in SHAPES:
        for tokens in (int(t) for t in args.tokens.split(",")):
            row = measure(shape, tokens, device)
            rows.append(row)
            print(f"{row['shape']:>20} {tokens:>6} tokens: triton {row['triton']['us']:>8} us "
                  f"({row['triton']['tflops']} TFLOP/s), grouped {row['grouped']['us']:>8} us "
                  f"({row['grouped']['tflops']} TFLOP/s), {row['speedup']}x; taken "
                  f"{row['grouped_taken']}; errors {row['triton']['max_error_of_twin_scale']:.1e}"
                  f" / {row['grouped']['max_error_of_twin_scale']:.1e}")
    if args.out:
        write_json(args.out, {"benchmark": "moe_prefill", "environment": environment(device),
                              "rows": rows})


if __name__ == "__main__":
    main()

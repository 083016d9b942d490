"""Which tile sizes are fastest on this GPU? Times candidate configurations of muse's
compute-bound Triton kernels at the shapes the benchmark models prefill.

Two sweeps (`--sweeps`), on random bf16 data, timed with `triton.testing.do_bench` (median of
repeated launches, the L2 cache flushed in between):

* `moe`: the fused experts' tiles (`muse.kernels.moe_triton.Tiles`) for 8192 tokens (and, for
  reference, 1) of the two MoE shapes; GEMM 1's tiles first, then GEMM 2's with the best
  GEMM 1;
* `attention`: the paged prefill attention's tiles for an 8192-token chunk over 0 and 24576
  cached tokens (32 query / 4 kv heads of 128).

do_bench times launches from Python without a CUDA graph, so kernels of a few microseconds
(decode sizes) measure mostly the launch; only the millisecond-scale prefill figures are
meaningful for choosing tiles.

    python benchmarks/tune_kernels.py --out tune.json
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import environment, write_json  # noqa: E402

DTYPE = torch.bfloat16


def _time_us(fn: Callable[[], object]) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40) * 1e3


def _timed(label: str, fn: Callable[[], object]) -> float | None:
    """Microseconds per call, or None (and a note) when the configuration does not run."""
    try:
        return _time_us(fn)
    except Exception as error:  # noqa: BLE001 - a tile that does not fit is an answer too
        print(f"    {label}: failed ({type(error).__name__}: {str(error)[:80]})")
        return None


# (name, experts, top-k, latent width, expert width) of the MoE shapes.
MOES = [("qwen3-30b-a3b", 128, 8, 2048, 768), ("muse-spark-15b-a2b", 256, 8, 1024, 640)]
MOE_TOKENS = (8192, 1)  # a prefill chunk, a decode step
GEMM1_PREFILL = [(64, 64, 8, 3), (64, 64, 8, 4), (128, 64, 8, 3), (64, 128, 8, 3),
                 (128, 32, 8, 4), (64, 64, 4, 4), (32, 64, 4, 4)]
GEMM2_PREFILL = [(128, 64, 8, 3), (128, 64, 8, 4), (64, 64, 8, 3), (64, 64, 4, 4),
                 (256, 64, 8, 3), (128, 128, 8, 3), (128, 32, 8, 4)]
GEMM_DECODE = [(32, 128, 4, 4), (32, 256, 4, 4), (32, 128, 4, 6), (64, 128, 4, 4),
               (16, 256, 4, 4), (32, 256, 4, 3), (64, 64, 4, 6)]


def sweep_moe(device: torch.device) -> list[dict]:
    from muse.kernels.moe_triton import Tiles, choose_tiles, fused_experts

    rows = []
    for (shape, experts, top_k, latent, inter), tokens in itertools.product(MOES, MOE_TOKENS):
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(tokens, latent, dtype=DTYPE, device=device, generator=gen)
        gate_up = torch.randn(experts, 2 * inter, latent, dtype=DTYPE, device=device,
                              generator=gen) * latent ** -0.5
        down = torch.randn(experts, latent, inter, dtype=DTYPE, device=device,
                           generator=gen) * inter ** -0.5
        norm = torch.ones(experts, latent, dtype=DTYPE, device=device)
        ids = torch.rand(tokens, experts, device=device, generator=gen).topk(top_k).indices
        weights = torch.full((tokens, top_k), 1 / top_k, device=device)
        current = choose_tiles(tokens * top_k, experts)
        decode = tokens == 1

        def run(tiles: Tiles) -> Callable[[], object]:
            return lambda: fused_experts(x, weights, ids, gate_up, down, norm, 1e-6,
                                         tiles=tiles)

        current_us = _time_us(run(current))
        block_m = current.block_m
        first = GEMM_DECODE if decode else GEMM1_PREFILL
        second = GEMM_DECODE if decode else GEMM2_PREFILL
        gemm1 = {c: _timed(str(c), run(Tiles(block_m, c, current.gemm2))) for c in first}
        ok1 = {c: t for c, t in gemm1.items() if t is not None}
        best1 = min(ok1, key=ok1.get)
        gemm2 = {c: _timed(str(c), run(Tiles(block_m, best1, c))) for c in second}
        ok2 = {c: t for c, t in gemm2.items() if t is not None}
        best2 = min(ok2, key=ok2.get)
        block_ms = {} if decode else {
            m: _timed(f"block_m {m}", run(Tiles(m, best1, best2))) for m in (64, 128)}
        flops = 2 * tokens * top_k * 3 * latent * inter
        row = {"shape": shape, "tokens": tokens, "current": str(current),
               "current_us": current_us, "best_gemm1": list(best1), "best_gemm2": list(best2),
               "best_us": ok2[best2], "block_m_us": {str(k): v for k, v in block_ms.items()},
               "gemm1_us": {str(list(c)): t for c, t in gemm1.items()},
               "gemm2_us": {str(list(c)): t for c, t in gemm2.items()},
               "tflops_best": flops / ok2[best2] / 1e6}
        rows.append(row)
        print(f"  moe {shape:18s} {tokens:5d} tokens: current {current_us:8.1f} us, best "
              f"{ok2[best2]:8.1f} us gemm1 {list(best1)} gemm2 {list(best2)} "
              f"({row['tflops_best']:.0f} TFLOP/s) block_m {row['block_m_us']}")
    return rows


# (query heads, kv heads, head dim) of the Qwen3 shapes; a chunk of 8K new tokens after 0
# and after 24K cached ones (the last chunk of a 32K prompt).
ATTENTION_HEADS = (32, 4, 128)
ATTENTION_CHUNK, ATTENTION_CACHED = 8192, (0, 24576)
ATTENTION_CONFIGS = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2),
                     (64, 64, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2), (128, 128, 8, 3)]


def sweep_attention(device: torch.device) -> list[dict]:
    from muse.kernels.attention_metadata import BatchMetadata, KindMetadata
    from muse.kernels.paged_attention_triton import _prefill

    (heads, kv_heads, head_dim), block_size, chunk = ATTENTION_HEADS, 16, ATTENTION_CHUNK
    rows = []
    for cached in ATTENTION_CACHED:
        total = cached + chunk
        blocks = total // block_size
        k_cache = torch.randn(blocks + 1, block_size, kv_heads, head_dim, dtype=DTYPE,
                              device=device)
        v_cache = torch.randn_like(k_cache)
        q = torch.randn(chunk, heads, head_dim, dtype=DTYPE, device=device)
        # The blocks in a shuffled order, as a paged cache holds them.
        table = (torch.randperm(blocks, device=device) + 1)[None]
        long = lambda *v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        kind = KindMetadata(slot_mapping=long(0), block_tables=table, first_block=long(0))
        meta = BatchMetadata(positions=long(0), token_request=long(0),
                             query_start=long(0, chunk), seq_lens=long(total),
                             max_query_len=chunk, kinds={"full": kind}, block_size=block_size)
        scale = head_dim ** -0.5
        timings = {c: _timed(str(c), lambda c=c: _prefill(
            q, k_cache, v_cache, meta, kind, None, scale, block_m=c[0], block_n=c[1],
            num_warps=c[2], num_stages=c[3])) for c in ATTENTION_CONFIGS}
        ok = {c: t for c, t in timings.items() if t is not None}
        best = min(ok, key=ok.get)
        flops = 4 * chunk * (cached + chunk / 2) * heads * head_dim
        row = {"cached": cached, "chunk": chunk, "best_config": list(best),
               "best_us": ok[best], "current_us": ok.get(ATTENTION_CONFIGS[0]),
               "tflops_best": flops / ok[best] / 1e6,
               "all": {str(list(c)): t for c, t in timings.items()}}
        rows.append(row)
        print(f"  attention {chunk} after {cached}: current {row['current_us'] or 0:9.1f} us, "
              f"best {ok[best]:9.1f} us {list(best)} ({row['tflops_best']:.0f} TFLOP/s)")
    return rows


SWEEPS = {"moe": sweep_moe, "attention": sweep_attention}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweeps", default="moe,attention")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    record = {"environment": environment(device)}
    for name in args.sweeps.split(","):
        print(f"{name}:")
        record[name] = SWEEPS[name](device)
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

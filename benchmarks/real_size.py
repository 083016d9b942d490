"""Full-size Muse Spark Open decoder layers on one GPU (or sharded over several: vLLM's
parallel flags): decode time per layer at several batch sizes and prefill time per token,
each against its roofline.

The model is the real one's shape (hidden 8192, 64 / 8 heads of 128, latent 4096, 256 experts
of width 4096, top-8, its vocabulary) cut to a few layers, alternating sliding and global as
the real model starts, with random weights. Each figure is measured on two such models, of
`--layers` A and B layers, and differenced, (t_B - t_A) / (B - A): what is left is the
layers' own time, without the embedding, the LM head, sampling and the step's host work.

- decode: `batch` requests of `--context` prompt tokens each, then steps of one token per
  request (the overlapped schedule on, CUDA graphs where they apply): the median time of
  `--decode-steps` steps after a warm-up;
- prefill: one `--prefill` token prompt, time to its first token, per prompt token.

Rooflines per layer (benchmarks/roofline.py, the H200's measured copy bandwidth and bf16
matmul rate): decode reads the layer's dense weights, min(E, batch x k) experts and every
request's KV; prefill computes every token's active weights and its attention.

    python benchmarks/real_size.py --out results/real-size.json            # on the H200
    python benchmarks/real_size.py --tensor-parallel-size 8 --enable-expert-parallel  # 8 GPUs
    python benchmarks/real_size.py --preset muse-spark-tiny --device cpu   # a smoke test
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import statistics
import time
from typing import Any

import numpy as np

from benchmarks.engines import build_muse, free_memory, random_prompt, synchronize
from benchmarks.options import add_parallel_args, num_gpus, parallel_engine_args
from benchmarks.report import environment, write_json
from benchmarks.roofline import (H200_BF16_MATMUL_FLOPS, H200_MEMORY_BANDWIDTH, Machine,
                                 ParameterBreakdown, attention_flops, kv_read_bytes)
from muse import SamplingParams
from muse.config import FULL, SLIDING, MuseSparkConfig, with_overrides
from muse.presets import get_preset

OPEN = "muse-spark-open-816b-a42b"


def cut_overrides(layers: int) -> dict[str, Any]:
    """`hf_overrides` that cut a preset to `layers` text layers, sliding and global in turn,
    with no encoders (they play no part in text steps). Every rank of a parallel layout
    applies them to the preset itself."""
    return {"num_hidden_layers": layers,
            "layer_types": [SLIDING if i % 2 == 0 else FULL for i in range(layers)],
            "vision_config": None, "audio_config": None}


def cut_config(preset: str, layers: int) -> MuseSparkConfig:
    return with_overrides(get_preset(preset), cut_overrides(layers))


def decode_step_s(llm, batch: int, context: int, steps: int, rng) -> float:
    engine, vocab = llm.engine, llm.engine.config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"d{batch}-{index}", random_prompt(rng, context, vocab), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for group in engine.requests.values() for r in group):
        engine.step()
    for _ in range(4):  # warm-up decode steps (graph replays)
        engine.step()
    times = []
    for _ in range(steps):
        synchronize(engine.device)
        start = time.perf_counter()
        engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times)


def prefill_s(llm, length: int, rng) -> float:
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for repeat in range(3):
        engine.add_request(f"p{length}-{repeat}", random_prompt(rng, length,
                                                               engine.config.vocab_size), params)
        synchronize(engine.device)
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        synchronize(engine.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first compiles


def measure(layers: int, args: argparse.Namespace) -> dict[str, Any]:
    name = f"{args.preset} cut to {layers} layers"
    llm, info = build_muse(args.preset, args.device, args.dtype,
                           hf_overrides=cut_overrides(layers), **parallel_engine_args(args),
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           max_num_seqs=max(args.batches),
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           quantization=args.quantization,
                           kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    rng = np.random.default_rng(0)
    try:
        steps = {}
        for batch in args.batches:
            steps[str(batch)] = decode_step_s(llm, batch, args.context, args.decode_steps, rng)
            print(f"{name}: decode step at batch {batch}: {steps[str(batch)] * 1e3:.3f} ms",
                  flush=True)  # as it comes: a run cut short still reports
        prefill = prefill_s(llm, args.prefill, rng)
        print(f"{name}: prefill of {args.prefill} tokens: {prefill * 1e3:.2f} ms", flush=True)
        return {"engine": info, "decode_step_s": steps, "prefill_s": prefill}
    finally:
        llm.shutdown()
        del llm
        free_memory(args.device)


def layer_rooflines(preset: str, args: argparse.Namespace, machine: Machine,
                    dtype_bytes: float) -> dict[str, Any]:
    """One layer's roofline time (the mean of a sliding and a global layer)."""
    two = cut_config(preset, 2).text_config
    params = ParameterBreakdown.of(two)
    decode = {}
    for batch in args.batches:
        weights = (params.per_layer_dense + params.experts_read(batch) * params.expert) \
            * dtype_bytes
        kv = batch * kv_read_bytes(two, args.context, 2) / 2
        flops = 2 * batch * (params.per_layer_dense + params.top_k * params.expert) \
            + batch * attention_flops(two, args.context, args.context + 1) / 2
        decode[str(batch)] = machine.time(weights + kv, flops)
    tokens = args.prefill
    flops = 2 * tokens * (params.per_layer_dense + params.top_k * params.expert) \
        + attention_flops(two, 0, tokens) / 2
    weights = (params.per_layer_dense + params.experts_read(tokens) * params.expert) \
        * dtype_bytes
    return {"decode_s": decode, "prefill_s": machine.time(weights, flops)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=OPEN, help="the model whose layers are timed")
    parser.add_argument("--layers", default="2,4",
                        help="the two layer counts whose difference is timed (even numbers)")
    parser.add_argument("--batches", default="1,8,64,256",
                        help="decode batch sizes (requests decoding at once)")
    parser.add_argument("--context", type=int, default=1024,
                        help="prompt tokens of each decoding request")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=8192, help="prefill prompt tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--quantization", default=None,
                        help="online quantization of the weights (nvfp4-w4a16, fp8, ...)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    add_parallel_args(parser)
    args = parser.parse_args(argv)
    import torch

    args.device = torch.device(args.device)
    args.batches = [int(b) for b in args.batches.split(",")]
    small, large = (int(n) for n in args.layers.split(","))
    if small % 2 or large % 2 or large <= small:
        raise SystemExit("--layers takes two even layer counts, the second larger")
    runs = {}
    for layers in (small, large):
        runs[layers] = measure(layers, args)
    per_layer = 1 / (large - small)
    gpus = num_gpus(args)  # a layer sharded over N GPUs reads and multiplies on all N
    machine = Machine(H200_MEMORY_BANDWIDTH * gpus, H200_BF16_MATMUL_FLOPS * gpus)
    bytes_per_weight = {None: 2, "fp8": 1, "nvfp4-w4a16": 0.5625, "mxfp4": 0.53125}.get(
        args.quantization, 2)
    roof = layer_rooflines(args.preset, args, machine, bytes_per_weight)
    decode = {}
    for batch in map(str, args.batches):
        seconds = (runs[large]["decode_step_s"][batch] - runs[small]["decode_step_s"][batch]) \
            * per_layer
        decode[batch] = {"layer_s": seconds, "roofline_s": roof["decode_s"][batch],
                         "roofline_fraction": roof["decode_s"][batch] / seconds
                         if seconds > 0 else None}
    prefill = (runs[large]["prefill_s"] - runs[small]["prefill_s"]) * per_layer
    record = {"benchmark": "real_size", "environment": environment(args.device),
              "preset": args.preset, "layers": [small, large], "context": args.context,
              "prefill_tokens": args.prefill, "quantization": args.quantization,
              "machine": machine.to_dict(), "gpus": gpus,
              "parallel": parallel_engine_args(args), "decode_per_layer": decode,
              "prefill_per_layer": {"layer_s": prefill, "per_token_s": prefill / args.prefill,
                                    "roofline_s": roof["prefill_s"],
                                    "roofline_fraction": roof["prefill_s"] / prefill
                                    if prefill > 0 else None},
              "runs": {str(k): {"decode_step_s": v["decode_step_s"],
                                "prefill_s": v["prefill_s"]} for k, v in runs.items()}}
    print(f"{args.preset}, {args.quantization or args.dtype}: one layer")
    for batch, cell in decode.items():
        fraction = cell["roofline_fraction"]
        print(f"  decode batch {batch:>4}: {cell['layer_s'] * 1e6:9.1f} us "
              f"(roofline {cell['roofline_s'] * 1e6:8.1f} us"
              + (f", {fraction:.0%})" if fraction else ")"))
    print(f"  prefill {args.prefill} tokens: {prefill * 1e3:.2f} ms, "
          f"{prefill / args.prefill * 1e6:.2f} us a token")
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

"""Mixed steps (prefill chunks beside decodes) with and without piecewise CUDA graphs.

Many short prompts arrive at once and are served to their end with steps of at most
`--max-num-batched-tokens` tokens, so almost every step mixes prefills with decodes: the
steps no whole-step graph covers. Two engines of one shape (random bf16 weights, the same
seed) are built side by side, one with `--enable-piecewise-cuda-graph`, and the workload
runs on each in turn, `--repeats` times (after one untimed run each). Reports the wall
time per workload, its steps and the share the piecewise graphs ran, and whether both gave
the same tokens (greedy; random weights may hold near ties that the padded products flip).

    python benchmarks/mixed_steps.py --shape muse-spark-15b-a2b --out OUT/mixed.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.engines import build_muse, random_prompt, synchronize  # noqa: E402
from benchmarks.options import resolve_device  # noqa: E402
from benchmarks.report import environment, write_json  # noqa: E402
from muse.engine.sampling_params import SamplingParams  # noqa: E402
from muse.presets import PRESETS  # noqa: E402

MODES = {"graphs": {"enable_piecewise_cuda_graph": False},
         "piecewise": {"enable_piecewise_cuda_graph": True}}


def run_workload(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int, list]:
    """(seconds, steps, tokens of every request) for the prompts served to their end."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"m{time.monotonic_ns()}-{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    synchronize(engine.device)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        for request in engine.step():
            if request.is_finished:
                tokens[request.request_id] = list(request.output_token_ids)
        steps += 1
    synchronize(engine.device)
    return time.perf_counter() - start, steps, [tokens[k] for k in sorted(tokens)]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the record as JSON here")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    rng = np.random.default_rng(0)
    engines = {}
    for mode, extra in MODES.items():
        llm, info = build_muse(args.shape, device, dtype, kv_cache_memory_bytes=8 * 2**30,
                               max_num_seqs=args.requests,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               enable_prefix_caching=False,  # every run prefills anew
                               piecewise_cuda_graph_max_tokens=args.max_num_batched_tokens,
                               **extra)
        engines[mode] = llm
    vocab = next(iter(engines.values())).engine.config.vocab_size
    prompts = [random_prompt(rng, args.prompt_len, vocab) for _ in range(args.requests)]
    results: dict[str, dict] = {mode: {"seconds": []} for mode in engines}
    for repeat in range(args.repeats + 1):  # the first run of each compiles and warms
        for mode, llm in engines.items():
            worker = llm.engine.executor.worker
            before = worker.piecewise.steps if worker.piecewise is not None else 0
            seconds, steps, tokens = run_workload(llm, prompts, args.output_len)
            if repeat:
                results[mode]["seconds"].append(seconds)
            results[mode].update(steps=steps, tokens=tokens, piecewise_steps=(
                worker.piecewise.steps - before if worker.piecewise is not None else 0))
    summary = {}
    for mode, result in results.items():
        median = statistics.median(result["seconds"])
        summary[mode] = {"seconds": result["seconds"], "median_s": median,
                         "steps": result["steps"], "piecewise_steps": result["piecewise_steps"],
                         "ms_per_step": median / result["steps"] * 1e3,
                         "prompt_tokens_per_s": args.requests * args.prompt_len / median}
        print(f"{args.shape} {mode}: {median * 1e3:.1f} ms for {args.requests} requests "
              f"({result['steps']} steps, {result['piecewise_steps']} piecewise, "
              f"{summary[mode]['ms_per_step']:.3f} ms a step)")
    same = results["graphs"]["tokens"] == results["piecewise"]["tokens"]
    speedup = summary["graphs"]["median_s"] / summary["piecewise"]["median_s"]
    print(f"piecewise / graphs speedup {speedup:.3f}x, same tokens: {same}")
    for llm in engines.values():
        llm.shutdown()
    record = {"benchmark": "mixed_steps", "environment": environment(device),
              "settings": vars(args), "modes": summary, "speedup": speedup,
              "same_tokens": same}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

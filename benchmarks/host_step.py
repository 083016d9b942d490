"""The host's share of a decode step: `engine.step()` over many decoding requests with the
model's forward replaced by logits of zeros, so that only the engine's own work is left
(scheduling, KV bookkeeping, batch preparation, copying the step into a decode graph's
static inputs as a GPU step does, sampling, request updates).

With hundreds of small requests this work, not the GPU, sets the pace of a throughput run
(the 0.6B shape at 256 requests). The vocabulary is cut (`--vocab`) so that sampling the
fake logits, which a GPU does asynchronously, costs the CPU little.

    python benchmarks/host_step.py --requests 256 --steps 100 --out host-step.json
    python benchmarks/host_step.py --profile 25          # the 25 costliest functions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.report import environment, write_json  # noqa: E402
from muse import LLM, SamplingParams  # noqa: E402
from muse.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from muse.engine.worker import ModelWorker  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="muse-spark-tiny")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="sets the graph's block-table width: about the 256-request "
                             "throughput run's (2,064 there: prompts and outputs up to 1,024 "
                             "tokens each; the tiny preset stops at 2,048)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--profile", type=int, default=0,
                        help="print this many functions by own time (cProfile; slower steps)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    llm = LLM(args.shape, device="cpu", dtype="float32", hf_overrides={"vocab_size": args.vocab},
              kv_cache_memory_bytes=1024 * 2**20, max_num_seqs=args.requests,
              max_model_len=max(args.max_model_len, args.prompt_tokens + args.steps + 64))
    engine = llm.engine
    logits = torch.zeros(args.requests, args.vocab)
    # The decode graphs' input copy, on the CPU: what a GPU step does before its replay.
    width = -(-engine.max_model_len // engine.args.block_size)
    graphs = DecodeGraphs(engine.model, [], {kind: width for kind in engine.num_blocks},
                          args.requests, engine.args.block_size, torch.device("cpu"))

    def execute(self, batch, rows, *rest, **kwargs):
        graphs.prepare(batch)
        return logits[:len(rows)]

    original = ModelWorker.execute
    ModelWorker.execute = execute
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True)
        for index in range(args.requests):
            engine.add_request(str(index), [(index * 7 + j) % (args.vocab - 16) + 8
                                            for j in range(args.prompt_tokens)], params)
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()
        for _ in range(3):
            engine.step()
        profiler = cProfile.Profile() if args.profile else None
        times = []
        for _ in range(args.steps):
            if profiler:
                profiler.enable()
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
            if profiler:
                profiler.disable()
    finally:
        ModelWorker.execute = original
        llm.shutdown()
    record = {"environment": environment(torch.device("cpu")), "shape": args.shape,
              "requests": args.requests, "steps": args.steps, "profiled": bool(args.profile),
              "host_ms_median": 1e3 * statistics.median(times),
              "host_ms_mean": 1e3 * statistics.mean(times)}
    write_json(args.out, record)
    print(f"host ms a decode step ({args.requests} requests, model skipped"
          f"{', cProfile on' if args.profile else ''}): median {record['host_ms_median']:.2f}, "
          f"mean {record['host_ms_mean']:.2f}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return record


if __name__ == "__main__":
    main()

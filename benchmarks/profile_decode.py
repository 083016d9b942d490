"""Where does a decode step's GPU time go? A kernel-by-kernel profile of muse's decode.

Builds the engine for a shape (random bf16 weights), prefills `--batch` prompts of
`--context` tokens, then profiles `--steps` decode steps with torch.profiler and prints the
kernels by total GPU time, plus the step time with and without CUDA graphs when both are
asked for. Writes the table as JSON with `--out`.

    python benchmarks/profile_decode.py --shape qwen3-30b-a3b-shape --batch 1 --context 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Runnable as `python benchmarks/profile_decode.py` from the repository root, uninstalled.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.engines import FIRST_PROMPT_ID, build_muse, free_memory  # noqa: E402
from benchmarks.report import environment, write_json  # noqa: E402
from benchmarks.shapes import SHAPES  # noqa: E402
from muse.engine.sampling_params import SamplingParams  # noqa: E402


def _decode_until(llm, steps: int) -> float:
    """Run `steps` engine steps; seconds per step."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        llm.engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def profile(shape: str, batch: int, context: int, steps: int, enforce_eager: bool,
            top: int) -> dict:
    device = torch.device("cuda")
    llm, _ = build_muse(shape, device, "bfloat16", enforce_eager=enforce_eager,
                        max_num_seqs=max(batch, 1), gpu_memory_utilization=0.85)
    vocab = llm.engine.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps * 4 + 16, ignore_eos=True)
    for index in range(batch):
        prompt = torch.randint(FIRST_PROMPT_ID, vocab, (context,),
                               generator=generator).tolist()
        llm.engine.add_request(f"r{index}", prompt, params)
    # Prefill (and a few decode steps so every bucket's kernels are warm).
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for group in llm.engine.requests.values() for r in group):
        llm.engine.step()
    _decode_until(llm, 4)
    step_s = _decode_until(llm, steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _decode_until(llm, steps)
    kernels = []
    for event in prof.key_averages():
        gpu_us = getattr(event, "device_time_total", 0.0)
        if gpu_us > 0:
            kernels.append({"name": event.key[:90], "calls_per_step": event.count / steps,
                            "us_per_step": gpu_us / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    total_us = sum(k["us_per_step"] for k in kernels)
    print(f"{shape} batch {batch} context {context} "
          f"{'eager' if enforce_eager else 'graphs'}: {step_s * 1e3:.3f} ms per step "
          f"({batch / step_s:.1f} tokens/s), kernels {total_us / 1e3:.3f} ms per step")
    for k in kernels[:top]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name']}")
    del llm
    free_memory(device)
    return {"shape": shape, "batch": batch, "context": context, "eager": enforce_eager,
            "step_ms": step_s * 1e3, "kernel_ms": total_us / 1e3, "kernels": kernels[:top]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-shape", choices=SHAPES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="graphs,eager",
                        help="comma-separated: graphs, eager")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    runs = [profile(args.shape, args.batch, args.context, args.steps, mode == "eager", args.top)
            for mode in args.modes.split(",")]
    record = {"environment": environment(torch.device("cuda")), "runs": runs}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

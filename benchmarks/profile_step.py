"""Where does a step's GPU time go? A kernel-by-kernel profile of muse's decode or prefill.

Builds the engine for a shape (random bf16 weights). `--phase decode` prefills `--batch`
prompts of `--context` tokens, then profiles `--steps` decode steps; `--phase prefill`
profiles whole prompts of `--context` tokens (after one untimed prompt of that size). Prints
the kernels by total GPU time per step (or per prompt) and the wall time, with and without
CUDA graphs when both are asked for (`--modes`). Writes the table as JSON with `--out`.

    python benchmarks/profile_step.py --shape qwen3-30b-a3b-shape --batch 1 --context 1024
    python benchmarks/profile_step.py --shape qwen3-30b-a3b-shape --phase prefill \
        --context 8192 --modes graphs
    python benchmarks/profile_step.py --shape muse-spark-15b-a2b --modes graphs \
        --quantization nvfp4-w4a16
    python benchmarks/profile_step.py --shape muse-spark-15b-a2b --phase prefill \
        --context 8192 --modes graphs --trace prefill.json   # then benchmarks/gpu_idle.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# Runnable as `python benchmarks/profile_step.py` from the repository root, uninstalled.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.engines import (  # noqa: E402
    FIRST_PROMPT_ID,
    build_muse,
    free_memory,
    synchronize,
)
from benchmarks.options import (add_parallel_args, parallel_engine_args,  # noqa: E402
                                resolve_device)
from benchmarks.report import environment, write_json  # noqa: E402
from muse.presets import PRESETS  # noqa: E402
from muse.engine.sampling_params import SamplingParams  # noqa: E402
from muse.quantization import ONLINE_FORMATS  # noqa: E402


def _steps_until_done(llm, steps: int | None = None) -> tuple[float, int]:
    """Run `steps` engine steps (or until no request is left): (seconds, steps run)."""
    device = llm.engine.device
    synchronize(device)
    start = time.perf_counter()
    count = 0
    while (count < steps) if steps is not None else llm.engine.has_unfinished():
        llm.engine.step()
        count += 1
    synchronize(device)
    return time.perf_counter() - start, count


def _kernel_table(prof, per: int) -> list[dict]:
    """GPU kernels by total time, per step (decode) or per prompt (prefill)."""
    kernels = []
    on_gpu = torch.cuda.is_available()
    for event in prof.key_averages():
        # The GPU's own events (kernels, copies); on a CPU run (a smoke test) the operators'
        # own CPU time stands in.
        if on_gpu and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        gpu_us = event.device_time_total if on_gpu else event.self_cpu_time_total
        if gpu_us > 0:
            kernels.append({"name": event.key[:90], "calls_per_step": event.count / per,
                            "us_per_step": gpu_us / per})
    return sorted(kernels, key=lambda k: -k["us_per_step"])


def _runtime_table(prof, per: int) -> list[dict]:
    """The host's CUDA runtime and driver calls (launches, copies, synchronizations,
    allocations) by host time, per step or prompt: what keeps the GPU waiting when the step
    takes longer than its kernels."""
    calls = [{"name": event.key, "calls_per_step": event.count / per,
              "host_us_per_step": event.self_cpu_time_total / per}
             for event in prof.key_averages()
             if event.key.startswith("cu") and event.self_cpu_time_total > 0]
    return sorted(calls, key=lambda c: -c["host_us_per_step"])


def _activities(device: torch.device) -> list:
    kind = torch.profiler.ProfilerActivity
    return [kind.CPU, kind.CUDA] if device.type == "cuda" else [kind.CPU]


def _prompt(vocab: int, length: int, generator: torch.Generator) -> list[int]:
    return torch.randint(FIRST_PROMPT_ID, vocab, (length,), generator=generator).tolist()


def profile(shape: str, phase: str, batch: int, context: int, steps: int,
            enforce_eager: bool, top: int, device: torch.device,
            quantization: str | None = None, parallel: dict | None = None,
            trace: str | None = None) -> dict:
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    llm, _ = build_muse(shape, device, dtype, enforce_eager=enforce_eager,
                        max_num_seqs=max(batch, 1), gpu_memory_utilization=0.85,
                        quantization=quantization, **(parallel or {}))
    vocab = llm.engine.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    if phase == "decode":
        params = SamplingParams(temperature=0.0, max_tokens=steps * 4 + 16, ignore_eos=True)
        for index in range(batch):
            llm.engine.add_request(f"r{index}", _prompt(vocab, context, generator), params)
        # Prefill, then a few decode steps so every kernel is compiled and warm.
        while any(r.num_computed_tokens < r.num_prompt_tokens
                  for group in llm.engine.requests.values() for r in group):
            llm.engine.step()
        _steps_until_done(llm, 4)
        seconds, per = _steps_until_done(llm, steps)
        with torch.profiler.profile(activities=_activities(device)) as prof:
            _steps_until_done(llm, steps)
        tokens = batch
    else:
        # Whole prompts of `context` tokens (in max_num_batched_tokens chunks), one token out;
        # the first prompt compiles the kernels for these sizes.
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def prefill(tag: str) -> tuple[float, int]:
            for index in range(batch):
                llm.engine.add_request(f"{tag}{index}", _prompt(vocab, context, generator),
                                       params)
            return _steps_until_done(llm)

        prefill("warm")
        seconds, _ = prefill("timed")
        per = 1
        with torch.profiler.profile(activities=_activities(device)) as prof:
            prefill("profiled")
        tokens = batch * context
    if trace:  # the profiled run's timeline, for benchmarks/gpu_idle.py or a trace viewer
        prof.export_chrome_trace(trace)
    kernels = _kernel_table(prof, per)
    total_us = sum(k["us_per_step"] for k in kernels)
    unit = "step" if phase == "decode" else "prefill"
    elapsed = seconds / per
    print(f"{shape} {quantization or dtype} {phase} batch {batch} context {context} "
          f"{'eager' if enforce_eager else 'graphs'}: {elapsed * 1e3:.3f} ms per {unit} "
          f"({tokens / elapsed:.1f} tokens/s), kernels {total_us / 1e3:.3f} ms per {unit}")
    for k in kernels[:top]:
        print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:6.1f}  {k['name']}")
    runtime = _runtime_table(prof, per) if device.type == "cuda" else []
    if runtime:
        print(f"  host CUDA runtime calls per {unit} (profiled run):")
    for call in runtime[:10]:
        print(f"  {call['host_us_per_step']:9.1f} us  x{call['calls_per_step']:6.1f}  "
              f"{call['name']}")
    llm.shutdown()  # ends its worker processes and leaves their world
    del llm
    free_memory(device)
    return {"shape": shape, "quantization": quantization, "parallel": parallel,
            "phase": phase, "batch": batch,
            "context": context,
            "eager": enforce_eager, "step_ms": elapsed * 1e3, "kernel_ms": total_us / 1e3,
            "kernels": kernels[:top], "runtime_calls": runtime[:top]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b-shape", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--phase", choices=["decode", "prefill"], default="decode",
                        help="decode: per step after prefilling; prefill: per whole prompt")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--modes", default="graphs,eager",
                        help="comma-separated: graphs, eager")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--quantization", default=None, choices=ONLINE_FORMATS,
                        help="quantize the random weights as they load (default: none)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", default=None,
                        help="write the profiled run's Chrome trace here (MODE replaced by the "
                             "mode, when several are run)")
    add_parallel_args(parser)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    runs = [profile(args.shape, args.phase, args.batch, args.context, args.steps,
                    mode == "eager", args.top, device, args.quantization,
                    parallel_engine_args(args),
                    args.trace and args.trace.replace("MODE", mode))
            for mode in args.modes.split(",")]
    record = {"environment": environment(device), "runs": runs}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

"""Where a batch-1 generation's wall time goes: prefill steps against decode (or verify)
steps, plain and speculative, on the shipped model.

Held-out chat prompts of the default model's task families (as `spec_decode.py` draws them)
run one after the other, each to its end of turn (up to --max-tokens), after an untimed
pass over the same prompts. Every `engine.step()` is timed and counted as a prefill step
when some request still had prompt tokens to compute before it. Prefix caching is off, so
every prompt is prefilled in the timed pass too.

    python benchmarks/batch1_steps.py --out batch1-steps.json        # needs a GPU to mean much
    python benchmarks/batch1_steps.py --device cpu --prompts 2 --max-tokens 16

--eager-verification adds a run of speculation whose verify graphs leave the greedy
verification to eager code after each replay (what holding it in the graph saves);
--read-back one whose verify steps are each read back before the next is made (no
overlapped schedule: what making the next verify step on the device saves);
--prefill-read-back re-times the speculative engine with each prompt's last chunk read back
before its first verify step is made (what making that step on the device saves).
`--seed 1 --per-family 16` draws `spec_decode.py`'s prompts (its defaults).
--profile FILE adds two more passes of each mode after the timed one, over its first
PROFILED_PROMPTS prompts, one under cProfile and one under torch.profiler, and writes to FILE
the Python functions by cumulative time and the operators by self host time and by device
time: where a step's time goes (the timed figures are from the pass without profilers);
--trace also writes each torch.profiler pass's timeline beside FILE.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.options import resolve_device  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from benchmarks.spec_decode import held_out_prompts  # noqa: E402
from muse import LLM, SamplingParams  # noqa: E402
from muse.engine import cuda_graphs  # noqa: E402
from muse.engine.args import EngineArgs  # noqa: E402
from muse.presets import SHIPPED_CHECKPOINT  # noqa: E402

MODES = {"plain": None, "speculative": {"method": "dspark"}}
PROFILED_PROMPTS = 4


def prefilling(engine: Any) -> bool:
    scheduler = engine.scheduler
    return any(r.num_computed_tokens < r.num_prompt_tokens
               for r in [*scheduler.waiting, *scheduler.running])


def profile_pass(run: Any, device: torch.device, title: str, path: Path,
                 trace: bool = False) -> None:
    """Two more passes, under cProfile and torch.profiler; their tables appended to `path`,
    and with `trace` the torch.profiler pass's timeline beside it (`PATH.TITLE.json.gz`,
    Chrome trace format: every kernel of every step, in order, with its start and length)."""
    import cProfile
    import gzip
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    python = cProfile.Profile()
    python.runcall(run)
    text = io.StringIO()
    pstats.Stats(python, stream=text).sort_stats("cumulative").print_stats(50)
    with path.open("a") as out:
        out.write(f"== {title}: Python functions by cumulative time\n{text.getvalue()}\n")

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        run()
    if trace:
        timeline = path.with_name(f"{path.stem}.{title}.json")
        prof.export_chrome_trace(str(timeline))
        with open(timeline, "rb") as raw, gzip.open(f"{timeline}.gz", "wb") as packed:
            packed.write(raw.read())
        timeline.unlink()
    averages = prof.key_averages()
    sections = [("self host time", "self_cpu_time_total")]
    if device.type == "cuda":
        sections.append(("device time", "self_device_time_total"))
    with path.open("a") as out:
        for name, key in sections:
            out.write(f"== {title}: operators by {name}\n")
            out.write(averages.table(sort_by=key, row_limit=30, max_name_column_width=60))
            out.write("\n")


def run_mode(args: argparse.Namespace, device: torch.device, name: str,
             speculative: dict | None, **engine_args: Any) -> dict[str, Any]:
    llm = LLM(args.model, device=str(device), speculative_config=speculative,
              enable_prefix_caching=False,
              prefill_graph_max_tokens=args.prefill_graph_max_tokens, **engine_args)
    prompts = held_out_prompts(llm.tokenizer, args.per_family, args.prompts,
                               args.seed).mix[:args.prompts]
    llm.tokenizer = None  # token ids in and out: no detokenizing per step
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(count: int | None = None) -> int:
        return sum(len(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                       .outputs[0].token_ids) for ids in prompts[:count])

    run()  # kernels compile at new sizes
    record = timed_run(llm, run, device, args.repeats)
    if args.profile:
        # A few prompts: the profiler keeps every operator it sees (gigabytes of them for an
        # eager run on the CPU).
        profile_pass(lambda: run(PROFILED_PROMPTS), device, name, Path(args.profile),
                     args.trace)
    if args.prefill_read_back and speculative is not None:
        # The same engine (its graphs and compiled drafter), the chain started only after.
        llm.engine.runner.chain_from_sampled_steps = False
        run()
        record["prefill_read_back"] = timed_run(llm, run, device, args.repeats)
    llm.shutdown()
    return record


def timed_run(llm: Any, run: Any, device: torch.device, repeats: int) -> dict[str, Any]:
    """`repeats` passes over the prompts: the figures of the pass of median wall time, and
    every pass's wall time."""
    passes = sorted((timed_pass(llm, run, device) for _ in range(repeats)),
                    key=lambda r: r["wall_s"])
    record = passes[len(passes) // 2]
    record["wall_s_runs"] = [r["wall_s"] for r in passes]
    return record


def timed_pass(llm: Any, run: Any, device: torch.device) -> dict[str, Any]:
    """One pass over the prompts with every engine step timed."""
    engine, steps = llm.engine, []
    step = engine.step

    def timed_step() -> Any:
        before = prefilling(engine)
        start = time.perf_counter()
        out = step()
        steps.append((before, time.perf_counter() - start))
        return out

    engine.step = timed_step
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    synchronize()
    start = time.perf_counter()
    tokens = run()
    synchronize()
    wall = time.perf_counter() - start
    engine.step = step
    record: dict[str, Any] = {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
                              "outside_steps_s": wall - sum(t for _, t in steps)}
    for name, want in (("prefill", True), ("decode", False)):
        times = [t for kind, t in steps if kind == want]
        record[name] = {"steps": len(times), "total_s": sum(times),
                        "mean_ms": 1e3 * sum(times) / max(1, len(times))}
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(SHIPPED_CHECKPOINT))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed passes per mode (the median's figures are reported)")
    parser.add_argument("--per-family", type=int, default=4,
                        help="held-out prompts drawn per task family (the mix follows them)")
    parser.add_argument("--prefill-graph-max-tokens", type=int,
                        default=EngineArgs.prefill_graph_max_tokens,
                        help="as the engine flag; 0 runs prefill steps eagerly")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--eager-verification", action="store_true",
                        help="also run speculation with the greedy verification outside the "
                             "verify graphs (what the graphs holding it save)")
    parser.add_argument("--read-back", action="store_true",
                        help="also run speculation with every verify step read back before "
                             "the next is made (no overlapped schedule: what chaining saves)")
    parser.add_argument("--prefill-read-back", action="store_true",
                        help="also re-time speculation with each prompt's last chunk read "
                             "back before its first verify step is made")
    parser.add_argument("--profile", default=None,
                        help="text file for one more pass of each mode under torch.profiler")
    parser.add_argument("--trace", action="store_true",
                        help="with --profile, also write each profiled pass's timeline "
                             "beside the text file (Chrome trace JSON, gzipped)")
    args = parser.parse_args(argv)
    if args.profile:
        Path(args.profile).write_text("")
    device = resolve_device(args.device)
    results = {mode: run_mode(args, device, mode, spec) for mode, spec in MODES.items()}
    if args.eager_verification:
        # The same speculation with the verify graphs returning hidden states only: the
        # greedy verification then runs eagerly after each replay.
        with patch.object(cuda_graphs, "GREEDY_VERIFY_MAX_LOGITS_BYTES", 0):
            results["speculative_eager_verification"] = run_mode(
                args, device, "speculative_eager_verification", MODES["speculative"])
    if args.read_back:
        results["speculative_read_back"] = run_mode(
            args, device, "speculative_read_back", MODES["speculative"], overlap_schedule=False)
    results["speedup"] = results["plain"]["wall_s"] / results["speculative"]["wall_s"]
    record = {"environment": environment(device), "model": args.model,
              "prompts": args.prompts, "max_tokens": args.max_tokens,
              "prefill_graph_max_tokens": args.prefill_graph_max_tokens, "results": results}
    write_json(args.out, record)
    timed = [(mode, r) for mode, r in results.items() if isinstance(r, dict)]
    timed += [(f"{mode}_prefill_read_back", r["prefill_read_back"]) for mode, r in timed
              if "prefill_read_back" in r]
    rows = [[mode, f"{r['wall_s'] * 1e3:.1f}", f"{r['tok_s']:.0f}",
             f"{r['prefill']['steps']} x {r['prefill']['mean_ms']:.2f}",
             f"{r['decode']['steps']} x {r['decode']['mean_ms']:.3f}"]
            for mode, r in timed]
    print(table(["mode", "wall ms", "tok/s", "prefill steps x ms", "decode steps x ms"], rows))
    print(f"speedup {results['speedup']:.2f}x")
    return record


if __name__ == "__main__":
    main()

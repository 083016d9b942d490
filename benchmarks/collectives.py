"""What do a decode step's collectives cost between GPUs? The engine's own collectives
(`muse.distributed` groups over NCCL) at a shape's decode sizes, for world sizes 2 to 8.

For each world size and each batch of `--tokens` tokens a rank holds:

* `all_reduce`: [tokens, hidden] in the model's dtype, what a row-parallel projection (the
  attention's `o_proj`, the experts' output) sums over tensor-parallel ranks;
* `all_gather + reduce_scatter`: the experts' inputs gathered from every data-parallel rank
  and their outputs summed back to the owners, as `FusedMoE` spreads experts over
  data-parallel ranks today;
* `all_to_all x2`: the alternative dispatch, each token's `top_k` rows sent to the ranks
  holding its experts and the results sent back (rows spread evenly: the balanced case).

Each op runs `--repeats` times after a warm-up; the figure is the median of CUDA-event times
on rank 0 (wall times on the CPU), with a barrier before each call so no rank's lateness
counts. Per step: the op times a layer's count of calls, times the shape's layers (two
all-reduces a layer with tensor parallelism: attention and MoE outputs; one MoE dispatch and
combine a layer with experts over data-parallel ranks).

    python benchmarks/collectives.py --world-sizes 2,4,8 --out collectives.json
    python benchmarks/collectives.py --device cpu --world-sizes 2 --tokens 1,8  # gloo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.options import parse_list  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from benchmarks.shapes import text_config  # noqa: E402
from muse.distributed.config import ParallelConfig  # noqa: E402
from muse.distributed.launch import spawn_workers  # noqa: E402
from muse.distributed.parallel_state import get_world_group  # noqa: E402
from muse.presets import PRESETS  # noqa: E402

OPS = ("all_reduce", "all_gather + reduce_scatter", "all_to_all x2")


def _timed(run, repeats: int, device: torch.device) -> float:
    """Median seconds of `run()` over `repeats` calls (after two warm-up calls)."""
    group = get_world_group()
    times = []
    for index in range(repeats + 2):
        group.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            began = time.perf_counter()
            run()
            seconds = time.perf_counter() - began
        if index >= 2:
            times.append(seconds)
    return statistics.median(times)


def _measure(rank: int, hidden: int, top_k: int, tokens: list[int], dtype: str,
             repeats: int) -> dict[int, dict[str, float]]:
    group = get_world_group()
    device = group.device
    element = getattr(torch, dtype)
    results = {}
    for count in tokens:
        x = torch.randn(count, hidden, dtype=element, device=device)
        # Every rank's tokens, as the gathered experts' output (summed, then scattered back).
        gathered_out = torch.randn(group.world_size * count, hidden, dtype=element,
                                   device=device)
        # A token's top_k rows, spread evenly over the ranks (padded to a multiple).
        rows = -(-count * top_k // group.world_size) * group.world_size
        dispatch = torch.randn(rows, hidden, dtype=element, device=device)
        results[count] = {
            "all_reduce": _timed(lambda: group.all_reduce(x.clone()), repeats, device),
            "all_gather + reduce_scatter": _timed(
                lambda: (group.all_gather(x, dim=0), group.reduce_scatter(gathered_out)),
                repeats, device),
            "all_to_all x2": _timed(
                lambda: group.all_to_all(group.all_to_all(dispatch)), repeats, device),
        }
    return results


def per_step(op: str, seconds: float, layers: int) -> float:
    """A decode step's time in `op`: two all-reduces a layer (attention and MoE outputs), or
    one dispatch and combine a layer."""
    return seconds * layers * (2 if op == "all_reduce" else 1)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--world-sizes", default=[2, 4, 8], type=parse_list)
    parser.add_argument("--tokens", default=[1, 8, 64, 256], type=parse_list,
                        help="decode tokens a rank holds")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    text = text_config(args.shape)
    available = torch.cuda.device_count() if device.type == "cuda" else max(args.world_sizes)
    results: dict[str, Any] = {}
    for size in args.world_sizes:
        if size > available:
            results[str(size)] = {"skipped": f"needs {size} GPUs, {available} here"}
            continue
        config = ParallelConfig(tensor_parallel_size=size)
        outputs = spawn_workers(_measure, config, args=(
            text.hidden_size, text.num_experts_per_tok or 1, args.tokens, args.dtype,
            args.repeats), backend="nccl" if device.type == "cuda" else "gloo")
        results[str(size)] = {
            str(count): {op: {"us": seconds * 1e6,
                              "step_ms": per_step(op, seconds, text.num_hidden_layers) * 1e3}
                         for op, seconds in ops.items()}
            for count, ops in outputs[0].items()}
    record = {"benchmark": "collectives", "environment": environment(device),
              "args": vars(args), "hidden_size": text.hidden_size,
              "layers": text.num_hidden_layers, "top_k": text.num_experts_per_tok,
              "results": results}
    write_json(args.out, record)
    rows = [[size, count, op, f"{figures['us']:.1f}", f"{figures['step_ms']:.3f}"]
            for size, by_count in results.items() if "skipped" not in by_count
            for count, ops in by_count.items() for op, figures in ops.items()]
    print(table(["ranks", "tokens", "op", "us a call", "ms a step"], rows))
    return record


if __name__ == "__main__":
    main()

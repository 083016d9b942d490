"""When is the GPU idle in a profiled step, and what was the host doing then?

Reads a Chrome trace of torch.profiler with CPU and CUDA activities (`profile_step.py --trace`)
and finds the gaps between the GPU's work (kernels, copies, memsets). Each gap is charged to
the GPU work that ends it: the runtime call that launched it (by correlation id) and the
innermost host operator around that call. A gap whose work was launched after the GPU had
already gone idle is the host's (it could not launch fast enough, or it waited for the GPU
before launching); the others were waits on the device. Prints the totals, the largest gaps
and the idle time summed by launching operator, and writes them as JSON with `--out`.

    python benchmarks/gpu_idle.py prefill.json [--min-gap-us 5] [--out idle.json]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
HOST_CATEGORIES = ("cpu_op", "user_annotation")


def load_events(path: str | Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


class _HostOps:
    """The host operators of each thread, to find the innermost one around a moment."""

    def __init__(self, events: list[dict]) -> None:
        self.by_thread: dict[Any, list[dict]] = defaultdict(list)
        for event in events:
            if event.get("cat") in HOST_CATEGORIES:
                self.by_thread[event.get("tid")].append(event)
        self.starts = {}
        for tid, ops in self.by_thread.items():
            ops.sort(key=lambda e: e["ts"])
            self.starts[tid] = [e["ts"] for e in ops]

    def innermost(self, tid: Any, moment: float) -> str | None:
        ops, starts = self.by_thread.get(tid, []), self.starts.get(tid, [])
        best = None
        for index in range(bisect.bisect_right(starts, moment) - 1, -1, -1):
            op = ops[index]
            if op["ts"] + op.get("dur", 0) >= moment:
                if best is None or op.get("dur", 0) < best.get("dur", 0):
                    best = op
            if moment - op["ts"] > 1e6:  # operators longer than a second are not searched
                break
        return best["name"] if best else None


def analyse(events: list[dict], min_gap_us: float = 5.0, top: int = 15) -> dict:
    """Busy and idle time of the GPU between its first and last work, and the gaps."""
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    if not gpu:
        raise ValueError("the trace has no GPU events: profile with the CUDA activity")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}
    host = _HostOps(events)
    busy_until = gpu[0]["ts"] + gpu[0].get("dur", 0)
    busy = busy_until - gpu[0]["ts"]
    gaps = []
    for event in gpu[1:]:
        start, end = event["ts"], event["ts"] + event.get("dur", 0)
        if start > busy_until:
            gap = start - busy_until
            launch = launches.get(event.get("args", {}).get("correlation"))
            launched_at = None if launch is None else launch["ts"] + launch.get("dur", 0)
            gaps.append({
                "idle_us": gap, "at_us": busy_until - gpu[0]["ts"],
                "next": event["name"][:90],
                "launch": None if launch is None else launch["name"],
                "host_late": launched_at is not None and launched_at > busy_until,
                "launched_by": None if launch is None else host.innermost(launch.get("tid"),
                                                                           launch["ts"]),
            })
        busy += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    span = busy_until - gpu[0]["ts"]
    counted = [g for g in gaps if g["idle_us"] >= min_gap_us]
    by_op: dict[str, float] = defaultdict(float)
    for gap in counted:
        by_op[gap["launched_by"] or "?"] += gap["idle_us"]
    first_host = min((starts[0] for starts in host.starts.values() if starts),
                     default=gpu[0]["ts"])
    lead_in = gpu[0]["ts"] - first_host
    return {
        "span_us": span, "busy_us": busy, "idle_us": span - busy,
        "lead_in_us": max(0.0, lead_in),
        "gaps": len(gaps), "gaps_counted": len(counted), "min_gap_us": min_gap_us,
        "idle_in_counted_gaps_us": sum(g["idle_us"] for g in counted),
        "host_late_us": sum(g["idle_us"] for g in counted if g["host_late"]),
        "largest": sorted(counted, key=lambda g: -g["idle_us"])[:top],
        "by_launching_op": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:top]),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace (.json or .json.gz)")
    parser.add_argument("--min-gap-us", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    result = analyse(load_events(args.trace), args.min_gap_us, args.top)
    print(f"GPU span {result['span_us'] / 1e3:.3f} ms: busy {result['busy_us'] / 1e3:.3f}, "
          f"idle {result['idle_us'] / 1e3:.3f} ms ({result['gaps']} gaps; "
          f"{result['idle_in_counted_gaps_us'] / 1e3:.3f} ms in {result['gaps_counted']} of "
          f">= {args.min_gap_us:g} us, {result['host_late_us'] / 1e3:.3f} ms of them launched "
          f"after the GPU went idle); host lead-in {result['lead_in_us'] / 1e3:.3f} ms")
    print("idle by the host operator that launched the next work:")
    for name, idle in result["by_launching_op"].items():
        print(f"  {idle:9.1f} us  {name}")
    print("largest gaps:")
    for gap in result["largest"]:
        print(f"  {gap['idle_us']:9.1f} us at {gap['at_us'] / 1e3:8.3f} ms  "
              f"{'host' if gap['host_late'] else 'device'}  {gap['launched_by']} -> "
              f"{gap['next']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

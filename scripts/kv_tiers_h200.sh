#!/usr/bin/env bash
# The KV-tier run of docs/performance.md: an agentic replay (128 sessions at once) on
# muse-spark-15b-a2b (random bf16 weights), one GPU, servers in turn:
#   unbounded  the default KV budget, which holds the whole working set (the reference hit
#              rate); its run also records the trace and warms the kernel caches
#   gpu-only   a GPU KV budget of KV_GB GiB, well below the working set (~1M tokens)
#   host-tier-POLICY  the same budget, with --kv-offload-gb HOST_GB below it, once per
#              write policy of POLICIES
# gpu-only and the host tiers run REPEATS times, interleaved (a server started later in the
# run has found more of its kernels compiled: interleaving spreads that over all of them).
# Each replays the same trace with the trace's own replies (identical requests); the last
# step prints the prefix-hit rate and TTFT p50 / p90 of each (the mean over the repeats,
# and each repeat's) and writes kv_tiers.json.
#
#   scripts/kv_tiers_h200.sh OUT
#
# Run from the repository root with a python3 that has muse's dependencies (on a GPU image
# without the web stack, install the wheels of scripts/fetch_server_wheels.sh first).
# SESSIONS (default 128), KV_GB (default 8: about 150K tokens of global-layer KV), HOST_GB
# (default 64), POLICIES (default "write_through write_back"), REPEATS (default 2),
# SYSTEM_TOKENS (default 4000), THINK_TIME (seconds between a session's turns, default 0:2),
# TOOL_RESULT_TOKENS (default 100:1500), RATE (sessions arriving per second; default: all
# at once), TIERS_FIRST (set: each repeat runs the host tiers before GPU-only) and MAX_LEN
# (default 32768) change the run.
#
# With the defaults the trace's working set is about 370K tokens and nearly every session is
# in a turn at once: the active set alone (~310K tokens) exceeds the GPU budget, so requests
# queue for GPU blocks with or without a tier. The paced run of docs/performance.md,
#   RATE=4 THINK_TIME=4:12 TOOL_RESULT_TOKENS=800:3000 KV_GB=20 scripts/kv_tiers_h200.sh OUT
# has sessions that arrive over ~30 s and pause between turns (a working set of ~810K
# tokens, an active set that fits the budget): a paused session's prefix is what the GPU
# evicts, the case a host tier serves.
set -u
OUT=${1:?usage: scripts/kv_tiers_h200.sh OUT}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8000}
MODEL=${MODEL:-muse-spark-15b-a2b}
SESSIONS=${SESSIONS:-128}
KV_GB=${KV_GB:-8}
HOST_GB=${HOST_GB:-64}
POLICIES=${POLICIES:-write_through write_back}
REPEATS=${REPEATS:-2}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-4000}
THINK_TIME=${THINK_TIME:-0:2}
TOOL_RESULT_TOKENS=${TOOL_RESULT_TOKENS:-100:1500}
RATE=${RATE:-}
MAX_LEN=${MAX_LEN:-32768}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=scripts/bench_server_lib.sh
source scripts/bench_server_lib.sh
stop_all_at_exit

if [ -n "$RATE" ]; then LOAD=(--request-rate "$RATE"); else LOAD=(--concurrency "$SESSIONS"); fi
replay() {  # RUN_ID [bench flags...]
    local run_id=$1; shift
    "$PYTHON" -m muse.cli bench serve --base-url "$URL" --output-dir "$OUT" --no-progress \
        "${LOAD[@]}" --sessions-per-level all --assistant-history trace --no-salt \
        --run-id "$run_id" "$@"
}

KV_BYTES=$("$PYTHON" -c "print(int($KV_GB * 2**30))")
start_server unbounded || exit 1
replay unbounded --workload agentic --num-sessions "$SESSIONS" --turns 3:5 --think-time "$THINK_TIME" \
    --system-tokens "$SYSTEM_TOKENS" --tool-result-tokens "$TOOL_RESULT_TOKENS" --output-tokens 30:300
stop_server
TRACE="$OUT/agentic-unbounded-trace.jsonl"
gpu_only() {  # REPEAT
    start_server "gpu-only-$1" --kv-cache-memory-bytes "$KV_BYTES" || exit 1
    replay "gpu-only-$1" --trace "$TRACE"
    stop_server
}
host_tiers() {  # REPEAT
    for POLICY in $POLICIES; do
        start_server "host-tier-$POLICY-$1" --kv-cache-memory-bytes "$KV_BYTES" \
            --kv-offload-gb "$HOST_GB" --kv-offload-write-policy "$POLICY" || exit 1
        replay "host-tier-$POLICY-$1" --trace "$TRACE"
        stop_server
    done
}
for REPEAT in $(seq 1 "$REPEATS"); do
    if [ -n "${TIERS_FIRST:-}" ]; then  # the other order
        host_tiers "$REPEAT"; gpu_only "$REPEAT"
    else
        gpu_only "$REPEAT"; host_tiers "$REPEAT"
    fi
done

"$PYTHON" - "$OUT" "$REPEATS" $POLICIES <<'PY'
import json, statistics, sys
from pathlib import Path

out, repeats = Path(sys.argv[1]), int(sys.argv[2])
tiers = [f"host-tier-{policy}" for policy in sys.argv[3:]]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def figures(run_id):
    record = json.loads((out / f"agentic-{run_id}.json").read_text())
    level = record["summaries"][0]
    # Returning turns (a session's second and later): the requests a lower tier can serve.
    later = [r["ttft_s"] * 1e3 for r in record["requests"] if r["turn"] > 0 and not r["error"]]
    return {"hit_rate": level["prefix_cache"]["server_hit_rate"],
            "ttft_p50_ms": level["ttft_ms"]["p50"], "ttft_p90_ms": level["ttft_ms"]["p90"],
            "later_turns_ttft_p50_ms": percentile(later, 0.5),
            "later_turns_ttft_p90_ms": percentile(later, 0.9),
            "itl_p50_ms": level["itl_ms"]["p50"], "duration_s": level["duration_s"],
            "completed": level["completed"], "failed": level["failed"]}


rows = {"unbounded": figures("unbounded")}
for name in ["gpu-only", *tiers]:
    runs = [figures(f"{name}-{r}") for r in range(1, repeats + 1)]
    row = {key: statistics.mean(run[key] for run in runs) for key in
           ("hit_rate", "ttft_p50_ms", "ttft_p90_ms", "later_turns_ttft_p50_ms",
            "later_turns_ttft_p90_ms", "itl_p50_ms", "duration_s")
           if all(run[key] is not None for run in runs)}
    row.update(failed=sum(run["failed"] for run in runs), runs=runs)
    rows[name] = row
base, gpu = rows["unbounded"], rows["gpu-only"]
for name in tiers:
    tier = rows[name]
    if tier["failed"] or "hit_rate" not in tier:
        continue  # a failed run has no figures to compare
    tier["hit_rate_share_of_unbounded"] = tier["hit_rate"] / base["hit_rate"]
    tier["p90_ttft_gain_over_gpu_only"] = 1 - tier["ttft_p90_ms"] / gpu["ttft_p90_ms"]
(out / "kv_tiers.json").write_text(json.dumps(rows, indent=2))
print(json.dumps({name: {k: v for k, v in row.items() if k != "runs"}
                  for name, row in rows.items()}, indent=2))
PY

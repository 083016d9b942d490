#!/usr/bin/env bash
# The serving runs of docs/performance.md: muse serving muse-spark-15b-a2b (random bf16
# weights) on one GPU, measured with `muse bench serve`:
#   agentic sessions at concurrency 1 and 128, and a shared-prefix TTFT sweep with and
#   without prefix caching (the same trace replayed).
#
#   scripts/serving_bench_h200.sh OUT
#
# Run from the repository root with a python3 that has muse's dependencies (PYTHONPATH=.
# is enough; muse need not be installed; on a GPU image without the web stack, install the
# wheels of scripts/fetch_server_wheels.sh first). Results, traces, plots and server logs go
# to OUT.
# The sizes are scaled to a few minutes of GPU time; docs/benchmarking.md has the full ones.
set -u
OUT=${1:?usage: scripts/serving_bench_h200.sh OUT}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8000}
MODEL=${MODEL:-muse-spark-15b-a2b}
MAX_LEN=${MAX_LEN:-32768}
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=scripts/bench_server_lib.sh
source scripts/bench_server_lib.sh
stop_all_at_exit

bench() {
    "$PYTHON" -m muse.cli bench serve --base-url "$URL" --output-dir "$OUT" --no-progress "$@"
}

start_server cache || exit 1
bench --workload agentic --num-sessions 128 --turns 3:5 --think-time 0:1 --system-tokens 4000 \
    --tool-result-tokens 100:1500 --output-tokens 30:300 --concurrency 1 \
    --sessions-per-level 2 --run-id agentic-c1
bench --trace "$OUT/agentic-agentic-c1-trace.jsonl" --concurrency 128 --sessions-per-level all \
    --run-id agentic-c128
bench --workload shared-prefix --num-groups 4 --requests-per-group 8 --input-tokens 16384 \
    --prefix-tokens 14672 --output-tokens 20 --concurrency 1,8,32 --run-id prefix-cache
stop_server
start_server nocache --no-enable-prefix-caching || exit 1
bench --trace "$OUT/shared-prefix-prefix-cache-trace.jsonl" --concurrency 1,8,32 \
    --run-id prefix-nocache
stop_server

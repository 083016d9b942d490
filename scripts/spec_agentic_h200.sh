#!/usr/bin/env bash
# Model-free speculation on the agentic workload of `muse bench serve`: the shipped default
# model served plainly, with n-gram (prompt lookup) and with suffix speculation, the same
# trace replayed against each, with the trace's scripted assistant replies in the history
# (`--assistant-history trace`), so every server sees the same conversations.
#
#   scripts/spec_agentic_h200.sh OUT [CONCURRENCY] [SESSIONS]
#
# Run from the repository root with a python3 that has muse's dependencies (PYTHONPATH=.
# is enough; on a GPU image without the web stack, install the wheels of
# scripts/fetch_server_wheels.sh first). Results, the trace and server logs go to OUT.
set -u
OUT=${1:?usage: scripts/spec_agentic_h200.sh OUT [CONCURRENCY] [SESSIONS]}
CONCURRENCY=${2:-1,8}
SESSIONS=${3:-8}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-checkpoints/muse-spark-default}
URL="http://127.0.0.1:8000"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

for mode in plain ngram suffix; do
    case $mode in
        plain) spec=() ;;
        ngram) spec=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 7}') ;;
        suffix) spec=(--speculative-config '{"method": "suffix", "num_speculative_tokens": 7}') ;;
    esac
    "$PYTHON" -m muse.cli serve "$MODEL" --port 8000 "${spec[@]}" > "$OUT/server-$mode.log" 2>&1 &
    server=$!
    for _ in $(seq 1 240); do
        "$PYTHON" -c "import urllib.request; urllib.request.urlopen('$URL/health')" 2>/dev/null \
            && break
        kill -0 "$server" 2>/dev/null || { echo "server $mode died"; tail -5 "$OUT/server-$mode.log"; }
        kill -0 "$server" 2>/dev/null || break
        sleep 1
    done
    trace=()
    [ -f "$OUT/agentic-plain/agentic-plain-trace.jsonl" ] \
        && trace=(--trace "$OUT/agentic-plain/agentic-plain-trace.jsonl") \
        || trace=(--workload agentic --num-sessions "$SESSIONS" --turns 3:5 --think-time 0:0)
    "$PYTHON" -m muse.cli bench serve --base-url "$URL" "${trace[@]}" \
        --concurrency "$CONCURRENCY" --assistant-history trace --no-progress \
        --run-id "$mode" --seed 3 --output-dir "$OUT/agentic-$mode"
    kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
done

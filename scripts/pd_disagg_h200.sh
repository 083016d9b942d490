#!/usr/bin/env bash
# Prefill / decode disaggregation against tensor parallelism on the same two GPUs, muse
# serving muse-spark-15b-a2b (random bf16 weights), measured with `muse bench serve`:
#   pd   a prefill instance on GPU 0 (`kv_producer`) and a decode instance on GPU 1
#        (`kv_consumer`), KV moved by CONNECTOR (MuseConnector or NixlConnector), behind
#        `muse router` (docs/serving.md, "Disaggregated prefill and decode")
#   tp2  one instance with --tensor-parallel-size 2 over both GPUs
# Each setup replays the same two traces: the shared-prefix workload (a TTFT sweep) and the
# agentic workload at concurrency 1 and 64, with the trace's scripted assistant replies, so
# both setups see identical requests. The last step prints TTFT and ITL p50 / p90 per
# workload, concurrency and setup and writes pd_disagg.json.
#
#   scripts/pd_disagg_h200.sh OUT
#
# Run from the repository root with a python3 that has muse's dependencies (on a GPU image
# without the web stack, install the wheels of scripts/fetch_server_wheels.sh first). Results,
# traces and server logs go to OUT. The router listens on PORT (default 8000), the prefill
# and decode instances on PORT+1 and PORT+2, the prefill instance's KV store on KV_PORT
# (default 14579); the tp2 instance takes PORT once the router is gone. PREFILL_GPU and
# DECODE_GPU (default 0 and 1) pick the GPUs.
# The sizes are scaled to a few minutes of GPU time; each is an environment variable:
# PREFIX_GROUPS (4), PREFIX_REQUESTS (8 per group), PREFIX_INPUT_TOKENS (16384),
# PREFIX_TOKENS (14672 shared), PREFIX_OUTPUT_TOKENS (20), PREFIX_CONCURRENCY (1,8,32);
# AGENTIC_SESSIONS (64), AGENTIC_CONCURRENCY (1,64), AGENTIC_PER_LEVEL (2x: sessions per
# simulated user), AGENTIC_SYSTEM_TOKENS (4000), AGENTIC_USER_TOKENS (200:1200),
# AGENTIC_TURNS (3:5), AGENTIC_TOOL_TOKENS (100:1500), AGENTIC_OUTPUT_TOKENS (30:300),
# AGENTIC_THINK_TIME (0:1); MAX_LEN (32768). SERVE_FLAGS adds flags to every instance.
# A dry run on the CPU: MODEL=muse-spark-tiny DEVICE=cpu MAX_LEN=512 and tiny sizes
# (tests/test_multigpu_scripts.py does this); TP=2 on the CPU runs over gloo.
set -u
OUT=${1:?usage: scripts/pd_disagg_h200.sh OUT}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8000}
KV_PORT=${KV_PORT:-14579}
MODEL=${MODEL:-muse-spark-15b-a2b}
MAX_LEN=${MAX_LEN:-32768}
CONNECTOR=${CONNECTOR:-MuseConnector}
PREFILL_GPU=${PREFILL_GPU:-0}
DECODE_GPU=${DECODE_GPU:-1}
PREFIX_GROUPS=${PREFIX_GROUPS:-4}
PREFIX_REQUESTS=${PREFIX_REQUESTS:-8}
PREFIX_INPUT_TOKENS=${PREFIX_INPUT_TOKENS:-16384}
PREFIX_TOKENS=${PREFIX_TOKENS:-14672}
PREFIX_OUTPUT_TOKENS=${PREFIX_OUTPUT_TOKENS:-20}
PREFIX_CONCURRENCY=${PREFIX_CONCURRENCY:-1,8,32}
AGENTIC_SESSIONS=${AGENTIC_SESSIONS:-64}
AGENTIC_CONCURRENCY=${AGENTIC_CONCURRENCY:-1,64}
AGENTIC_PER_LEVEL=${AGENTIC_PER_LEVEL:-2x}
AGENTIC_SYSTEM_TOKENS=${AGENTIC_SYSTEM_TOKENS:-4000}
AGENTIC_USER_TOKENS=${AGENTIC_USER_TOKENS:-200:1200}
AGENTIC_TURNS=${AGENTIC_TURNS:-3:5}
AGENTIC_TOOL_TOKENS=${AGENTIC_TOOL_TOKENS:-100:1500}
AGENTIC_OUTPUT_TOKENS=${AGENTIC_OUTPUT_TOKENS:-30:300}
AGENTIC_THINK_TIME=${AGENTIC_THINK_TIME:-0:1}
case $CONNECTOR in
    MuseConnector|NixlConnector) ;;
    *) echo "CONNECTOR must be MuseConnector or NixlConnector, not $CONNECTOR"; exit 2 ;;
esac
URL="http://127.0.0.1:$PORT"
PREFILL_URL="http://127.0.0.1:$((PORT + 1))"
DECODE_URL="http://127.0.0.1:$((PORT + 2))"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=scripts/bench_server_lib.sh
source scripts/bench_server_lib.sh
stop_all_at_exit
# Flags of every instance: the context, the device (a CPU dry run) and SERVE_FLAGS.
SERVE=(--max-model-len "$MAX_LEN")
[ -n "${DEVICE:-}" ] && SERVE+=(--device "$DEVICE")
read -r -a EXTRA <<< "${SERVE_FLAGS:-}"
SERVE+=("${EXTRA[@]}")

bench() {  # BASE_URL [bench flags...]
    local base_url=$1; shift
    "$PYTHON" -m muse.cli bench serve --base-url "$base_url" --output-dir "$OUT" --no-progress \
        --num-gpus 2 "$@"
}

replay() {  # BASE_URL SETUP: both traces, results in OUT/{shared-prefix,agentic}-SETUP.json
    bench "$1" --trace "$PREFIX_TRACE" --concurrency "$PREFIX_CONCURRENCY" --run-id "$2" \
        || return 1
    bench "$1" --trace "$AGENTIC_TRACE" --concurrency "$AGENTIC_CONCURRENCY" \
        --sessions-per-level "$AGENTIC_PER_LEVEL" --assistant-history trace --run-id "$2"
}

PRODUCER="{\"kv_role\": \"kv_producer\", \"kv_connector\": \"$CONNECTOR\", \"kv_port\": $KV_PORT}"
CONSUMER="{\"kv_role\": \"kv_consumer\", \"kv_connector\": \"$CONNECTOR\"}"
launch prefill env CUDA_VISIBLE_DEVICES="$PREFILL_GPU" \
    "$PYTHON" -m muse.cli serve "$MODEL" --port "$((PORT + 1))" \
    "${SERVE[@]}" --kv-transfer-config "$PRODUCER"
PREFILL=$LAST
launch decode env CUDA_VISIBLE_DEVICES="$DECODE_GPU" \
    "$PYTHON" -m muse.cli serve "$MODEL" --port "$((PORT + 2))" \
    "${SERVE[@]}" --kv-transfer-config "$CONSUMER"
DECODE=$LAST
wait_healthy prefill "$PREFILL_URL" "$PREFILL" || exit 1
wait_healthy decode "$DECODE_URL" "$DECODE" || exit 1
# The router needs no GPU.
launch router env CUDA_VISIBLE_DEVICES= \
    "$PYTHON" -m muse.cli router --prefill "$PREFILL_URL" --decode "$DECODE_URL" \
    --port "$PORT"
wait_healthy router "$URL" "$LAST" || exit 1

# The traces are written from the prefill instance: the router has no /tokenize, and without
# it prompts would be sized by an estimate of characters per token, not by the tokenizer.
bench "$PREFILL_URL" --trace-only --run-id trace --workload shared-prefix \
    --num-groups "$PREFIX_GROUPS" --requests-per-group "$PREFIX_REQUESTS" \
    --input-tokens "$PREFIX_INPUT_TOKENS" --prefix-tokens "$PREFIX_TOKENS" \
    --output-tokens "$PREFIX_OUTPUT_TOKENS" || exit 1
bench "$PREFILL_URL" --trace-only --run-id trace --workload agentic \
    --num-sessions "$AGENTIC_SESSIONS" --system-tokens "$AGENTIC_SYSTEM_TOKENS" \
    --user-tokens "$AGENTIC_USER_TOKENS" --turns "$AGENTIC_TURNS" \
    --tool-result-tokens "$AGENTIC_TOOL_TOKENS" --output-tokens "$AGENTIC_OUTPUT_TOKENS" \
    --think-time "$AGENTIC_THINK_TIME" || exit 1
PREFIX_TRACE="$OUT/shared-prefix-trace-trace.jsonl"
AGENTIC_TRACE="$OUT/agentic-trace-trace.jsonl"

replay "$URL" pd || exit 1
stop_all

launch tp2 env CUDA_VISIBLE_DEVICES="$PREFILL_GPU,$DECODE_GPU" \
    "$PYTHON" -m muse.cli serve "$MODEL" --port "$PORT" \
    "${SERVE[@]}" --tensor-parallel-size 2
wait_healthy tp2 "$URL" "$LAST" || exit 1
replay "$URL" tp2 || exit 1
stop_all

"$PYTHON" - "$OUT" "$MODEL" "$CONNECTOR" <<'PY'
import json, sys
from pathlib import Path

out, model, connector = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
setups = {"pd": f"a prefill and a decode instance, one GPU each, {connector}, "
                "behind muse router",
          "tp2": "one instance, --tensor-parallel-size 2"}


def levels(workload, setup):
    results = json.loads((out / f"{workload}-{setup}.json").read_text())
    return {str(level["concurrency"]): {
        "ttft_p50_ms": level["ttft_ms"]["p50"], "ttft_p90_ms": level["ttft_ms"]["p90"],
        "itl_p50_ms": level["itl_ms"]["p50"], "itl_p90_ms": level["itl_ms"]["p90"],
        "completed": level["completed"], "failed": level["failed"]}
        for level in results["summaries"]}


rows = {workload: {setup: levels(workload, setup) for setup in setups}
        for workload in ("shared-prefix", "agentic")}
for row in rows.values():
    # pd against tp2 at each concurrency: negative is faster with disaggregation.
    row["pd_vs_tp2"] = {}
    for concurrency, pd in row["pd"].items():
        tp2 = row["tp2"].get(concurrency)
        if tp2 is not None:
            row["pd_vs_tp2"][concurrency] = {
                f"{key}_change": pd[key] / tp2[key] - 1
                for key in ("ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms")
                if pd[key] and tp2[key]}
# A prompt whose pull failed was computed on the decode instance, which is no disaggregation:
# the decode log names each.
log = (out / "server-decode.log").read_text(errors="replace")
summary = {"model": model, "connector": connector, "setups": setups,
           "failed_kv_pulls": log.count("computing the prompt here instead"), **rows}
(out / "pd_disagg.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY

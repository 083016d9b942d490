#!/usr/bin/env bash
# Sequence-parallel prefill on the shared-prefix workload: does splitting a long prompt's
# tokens over the GPUs (`--prefill-context-parallel-size`) cut p90 TTFT against tensor
# parallelism alone on the same GPUs, as announced (-28% to -42%)? muse serving
# muse-spark-15b-a2b (random bf16 weights) on NUM_GPUS GPUs (default 4), two servers in turn:
#   tp  --tensor-parallel-size NUM_GPUS
#   cp  --tensor-parallel-size NUM_GPUS/CP_SIZE --prefill-context-parallel-size CP_SIZE
# measured with `muse bench serve --workload shared-prefix` at its defaults (groups of 8
# requests of 80,000 tokens sharing a 73,360-token prefix, 20 output tokens) over
# concurrency 1,2,4,8,16,32,64; the cp server replays the tp server's trace.
#
#   scripts/context_parallel_h200.sh OUT
#
# The layouts: the engine's world is data x pipeline x context x tensor ranks
# (docs/architecture.md), one GPU each, so TP=N together with PCP=N would need N x N GPUs
# and is refused on N. The context-parallel server therefore trades tensor ranks for context
# ranks on the same GPUs. CP_SIZE=2 (the default; TP=N/2 x PCP=2) keeps half the weight and
# KV-head split of TP=N, so decode steps, which every context rank runs whole, still run on
# two-way tensor-parallel weights; CP_SIZE=NUM_GPUS (PCP=N, TP=1) splits prefill tokens
# N ways, with the whole model and every KV head on each GPU. Either way a prefill step costs
# each GPU the same FLOPs as under TP=N: what changes is the communication (context ranks
# all-gather K/V, tensor ranks all-reduce activations) and the shapes of the GEMMs.
#
# Run from the repository root with a python3 that has muse's dependencies (on a GPU image
# without the web stack, install the wheels of scripts/fetch_server_wheels.sh first). Results,
# the trace and server logs go to OUT; the last step prints p50 / p90 TTFT per concurrency
# and the relative change of p90 and writes context_parallel.json.
# NUM_GPUS (4), CP_SIZE (2), NUM_GROUPS (8), REQUESTS_PER_GROUP (8), INPUT_TOKENS (80000),
# PREFIX_TOKENS (73360), OUTPUT_TOKENS (20), CONCURRENCY (1,2,4,8,16,32,64), MAX_LEN (81920),
# PORT (8000) change the run; SERVE_FLAGS adds flags to both servers (the same for both,
# e.g. --max-num-batched-tokens).
# A dry run on the CPU: MODEL=muse-spark-tiny DEVICE=cpu NUM_GPUS=2 MAX_LEN=512 and tiny
# sizes (tests/test_multigpu_scripts.py does this); the ranks then talk over gloo.
set -u
OUT=${1:?usage: scripts/context_parallel_h200.sh OUT}
PYTHON=${PYTHON:-python3}
PORT=${PORT:-8000}
MODEL=${MODEL:-muse-spark-15b-a2b}
NUM_GPUS=${NUM_GPUS:-4}
CP_SIZE=${CP_SIZE:-2}
NUM_GROUPS=${NUM_GROUPS:-8}
REQUESTS_PER_GROUP=${REQUESTS_PER_GROUP:-8}
INPUT_TOKENS=${INPUT_TOKENS:-80000}
PREFIX_TOKENS=${PREFIX_TOKENS:-73360}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-20}
CONCURRENCY=${CONCURRENCY:-1,2,4,8,16,32,64}
# 80,000 prompt tokens, the chat template's and the salt's few, and the output.
MAX_LEN=${MAX_LEN:-81920}
if [ "$CP_SIZE" -lt 2 ] || [ $((NUM_GPUS % CP_SIZE)) -ne 0 ]; then
    echo "CP_SIZE ($CP_SIZE) must be at least 2 and divide NUM_GPUS ($NUM_GPUS)"; exit 2
fi
CP_TP=$((NUM_GPUS / CP_SIZE))
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# shellcheck source=scripts/bench_server_lib.sh
source scripts/bench_server_lib.sh
stop_all_at_exit
# A CPU dry run's device, beside SERVE_FLAGS (start_server adds them to both servers).
[ -n "${DEVICE:-}" ] && SERVE_FLAGS="${SERVE_FLAGS:-} --device $DEVICE"

bench() {
    "$PYTHON" -m muse.cli bench serve --base-url "$URL" --output-dir "$OUT" --no-progress \
        --num-gpus "$NUM_GPUS" --concurrency "$CONCURRENCY" "$@"
}

TP_LAYOUT=(--tensor-parallel-size "$NUM_GPUS")
CP_LAYOUT=(--tensor-parallel-size "$CP_TP" --prefill-context-parallel-size "$CP_SIZE")
start_server tp "${TP_LAYOUT[@]}" || exit 1
bench --workload shared-prefix --num-groups "$NUM_GROUPS" \
    --requests-per-group "$REQUESTS_PER_GROUP" --input-tokens "$INPUT_TOKENS" \
    --prefix-tokens "$PREFIX_TOKENS" --output-tokens "$OUTPUT_TOKENS" --run-id tp || exit 1
stop_server
start_server cp "${CP_LAYOUT[@]}" || exit 1
bench --trace "$OUT/shared-prefix-tp-trace.jsonl" --run-id cp || exit 1
stop_server

"$PYTHON" - "$OUT" "$MODEL" "$NUM_GPUS" "${TP_LAYOUT[*]}" "${CP_LAYOUT[*]}" <<'PY'
import json, sys
from pathlib import Path

out, model, num_gpus = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
layouts = {"tp": sys.argv[4], "cp": sys.argv[5]}
runs = {name: json.loads((out / f"shared-prefix-{name}.json").read_text()) for name in layouts}
summary = {"model": model, "num_gpus": num_gpus, "layouts": layouts,
           "workload": runs["tp"]["config"]["trace_settings"]}
for figure in ("p50", "p90"):
    summary[f"{figure}_ttft_ms"] = {
        name: {str(level["concurrency"]): level["ttft_ms"][figure]
               for level in run["summaries"]} for name, run in runs.items()}
tp, cp = summary["p90_ttft_ms"]["tp"], summary["p90_ttft_ms"]["cp"]
# cp against tp at each concurrency: negative is faster with context parallelism.
summary["p90_ttft_change"] = {c: cp[c] / tp[c] - 1 for c in tp if c in cp and tp[c]}
summary["announced"] = {"p90_ttft_change": [-0.28, -0.42],
                        "setup": "tensor parallelism alone against tensor parallelism with "
                                 "sequence-parallel prefill, the same GPUs"}
summary["failed"] = {name: sum(level["failed"] for level in run["summaries"])
                     for name, run in runs.items()}
(out / "context_parallel.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY

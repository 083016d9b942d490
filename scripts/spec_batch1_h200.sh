#!/usr/bin/env bash
# Issue 14's batch-1 speedup on an H200, in one device call (about 4 minutes):
#
#   scripts/spec_batch1_h200.sh OUT
#
# 1. the GPU tests of the verify and draft graphs (graph against eager output and acceptance),
#    chained verify steps included;
# 2. where a batch-1 generation's time goes, plain against speculative, on the prompts of
#    part 3, and speculation with each prompt's last chunk read back before its first verify
#    step is made (`batch1_steps.py --prefill-read-back`); with READ_BACK=1 also with each
#    verify step read back before the next is made (`--read-back`); with PROFILE=1 also with
#    the greedy verification out of the verify graphs (`--eager-verification`) and a profile
#    of each;
# 3. the end-to-end figure (`spec_decode.py --sections speed --concurrency 1`).
#
# Run from the repository root with the GPU image's python3. Each part runs only if BUDGET
# (seconds, default 540) leaves it room, so what finished comes back: OUT gets log.txt,
# batch1-steps.json, spec-speed-c1.json (and with PROFILE=1 batch1-profile.txt).
set -u
OUT=${1:?usage: scripts/spec_batch1_h200.sh OUT}
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG="$OUT/log.txt"
START=$SECONDS

part() {  # part NEEDED_SECONDS COMMAND...: runs it if that much time is left, within the rest
    local need=$1 left=$((BUDGET - (SECONDS - START)))
    shift
    if [ "$left" -lt "$need" ]; then echo "skipped (${left} s left): $*" >> "$LOG"; return; fi
    echo "+ $* (${left} s left)" >> "$LOG"
    timeout $((left - 3)) "$@" >> "$LOG" 2>&1
    echo "rc=$? at $((SECONDS - START)) s" >> "$LOG"
}

git log --oneline -1 >> "$LOG" 2>&1
part 90 "$PYTHON" -m pytest -q -p no:cacheprovider tests/speculative/test_shipped_drafter.py \
    tests/speculative/test_drafter_engine.py tests/speculative/test_chained_steps.py \
    tests/speculative/test_draft_kv.py tests/kernels/test_chained_rows.py \
    tests/engine/test_cuda_graphs.py
part 120 "$PYTHON" benchmarks/batch1_steps.py --seed 1 --per-family 16 --repeats 3 \
    --prefill-read-back ${READ_BACK:+--read-back} ${PROFILE:+--eager-verification} \
    --out "$OUT/batch1-steps.json" ${PROFILE:+--profile "$OUT/batch1-profile.txt"}
part 60 "$PYTHON" benchmarks/spec_decode.py --sections speed --concurrency 1 --num-prompts 16 \
    --max-tokens 256 --repeats 5 --out "$OUT/spec-speed-c1.json"
echo "done at $((SECONDS - START)) s" >> "$LOG"
cat "$LOG"

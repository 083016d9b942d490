#!/usr/bin/env bash
# What issue 6 still needs from an H200, in parts that each fit one device call:
#
#   scripts/decode_check_h200.sh OUT tests     # kernel, engine and reference tests, compiled
#   scripts/decode_check_h200.sh OUT latency   # batch-1 decode, overlapped schedule on and off
#   scripts/decode_check_h200.sh OUT profile   # kernel profiles of a decode step (graphs)
#
# Run from the repository root with the GPU image's python3 (PYTHONPATH=. is enough). Logs and
# JSON go to OUT; MUSE_COMMIT names the commit in the JSON.
set -u
OUT=${1:?usage: scripts/decode_check_h200.sh OUT tests|latency|profile}
PART=${2:?usage: scripts/decode_check_h200.sh OUT tests|latency|profile}
PYTHON=${PYTHON:-python3}
SHAPES=${SHAPES:-"qwen3-30b-a3b-shape muse-spark-15b-a2b"}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

case $PART in
tests)
    # The GPU image lacks some of the server's packages: the host-side modules that need
    # them are left to CI (named in the log), the rest run compiled. The whole log is kept,
    # so that a failure's message comes back with it.
    IGNORED=()
    for pair in xgrammar:test_structured_output xgrammar:test_grammar_compile \
                jsonschema:test_strict_tool_calls openai:test_nixl_connector \
                msgspec:test_step_message; do
        "$PYTHON" -c "import ${pair%%:*}" 2> /dev/null \
            || IGNORED+=(--ignore "tests/engine/${pair#*:}.py")
    done
    echo "left to CI (a package missing here): ${IGNORED[*]:-none}" > "$OUT/tests_h200.log"
    timeout "${TEST_TIMEOUT:-540}" "$PYTHON" -m pytest tests/kernels tests/engine \
        tests/test_reference.py -o addopts="" -q -p no:cacheprovider "${IGNORED[@]}" \
        >> "$OUT/tests_h200.log" 2>&1
    tail -40 "$OUT/tests_h200.log"
    ;;
latency)
    for shape in $SHAPES; do
        for mode in overlap serial; do
            flag=""
            [ "$mode" = serial ] && flag="--disable-overlap-schedule"
            "$PYTHON" benchmarks/latency.py --shape "$shape" --engines muse --repeats 2 \
                --lengths 1024,8192 $flag --out "$OUT/latency-$shape-$mode.json" \
                2>&1 | tail -8
        done
    done
    ;;
profile)
    for shape in $SHAPES; do
        "$PYTHON" benchmarks/profile_step.py --shape "$shape" --batch 1 --context 1024 \
            --modes graphs --out "$OUT/profile-$shape.json" 2>&1 | tail -25
    done
    ;;
*)
    echo "unknown part $PART: tests, latency or profile"; exit 2
    ;;
esac

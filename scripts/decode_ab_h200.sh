#!/usr/bin/env bash
# Batch-1 decode with and without environment switches, on one machine, interleaved: what a
# kernel change must show before it is kept (issue 19: keep what moves the end-to-end figure).
#
#   scripts/decode_ab_h200.sh OUT [SETTING ...]
#
# Each SETTING is "base" (the defaults) or space-free VAR=VALUE pairs joined by commas, e.g.
#   scripts/decode_ab_h200.sh /tmp/ab base MUSE_PDL=0
# (the default list). Every shape of SHAPES runs every setting ROUNDS times (default 2), the
# settings in turn within a round, so that a drifting machine favours none of them; each run
# writes OUT/latency-SHAPE-SETTING-rROUND.json and one line of OUT/ab.log. LENGTHS (default
# 1024) are the prompt lengths. DRY_RUN=1 prints the commands instead. A run takes about 7 s
# on an H200 (four settings, two shapes, two rounds: 16 runs in under two minutes).
set -u
OUT=${1:?usage: scripts/decode_ab_h200.sh OUT [SETTING ...]}
shift
SETTINGS=("$@")
[ ${#SETTINGS[@]} -eq 0 ] && SETTINGS=(base MUSE_PDL=0)
PYTHON=${PYTHON:-python3}
SHAPES=${SHAPES:-"muse-spark-15b-a2b qwen3-30b-a3b-shape"}
ROUNDS=${ROUNDS:-2}
LENGTHS=${LENGTHS:-1024}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1
mkdir -p "$OUT"

for round in $(seq 1 "$ROUNDS"); do
    for shape in $SHAPES; do
        for setting in "${SETTINGS[@]}"; do
            env_args=()
            [ "$setting" != base ] && IFS=, read -r -a env_args <<< "$setting"
            name=$(echo "$setting" | tr ',=' '+-')
            json="$OUT/latency-$shape-$name-r$round.json"
            cmd=(env "${env_args[@]}" "$PYTHON" benchmarks/latency.py --shape "$shape"
                 --engines muse --repeats 2 --lengths "$LENGTHS" --out "$json")
            if [ -n "${DRY_RUN:-}" ]; then
                echo "${cmd[*]}"
                continue
            fi
            figure=$("${cmd[@]}" 2>&1 | grep ' muse ' | tr -s ' ' | tr '\n' ';')
            echo "$shape $setting round $round: $figure" | tee -a "$OUT/ab.log"
        done
    done
done

#!/usr/bin/env bash
# Retrain the drafter shipped with the default model, on one GPU, from
# checkpoints/muse-spark-default (the target, frozen).
#
#   scripts/train_drafter.sh OUT [MINUTES]
#
# Run from the repository root, with a python3 that has torch, tokenizers, safetensors and
# jinja2; muse itself need not be installed. The engine answers NUM_PROMPTS (default 8192)
# training prompts and EVAL_PROMPTS (default 256) held-out prompts on the GPU, MINUTES
# (default 4) of training follow, then the offline acceptance evaluation on the held-out
# answers: the whole command fits in about 8 minutes on an H200.
#
# SEED (default 0) seeds the prompts, the initial weights and the anchors; METHOD (default
# dspark), NUM_LAYERS (default 1), LR (default 6e-4) and BATCH_SIZE (default 32 sequences)
# are passed on; EXTRA holds further `muse train drafter` flags. The run folder goes to
# $WORK (default /tmp/muse-drafter).
# OUT receives only small files, at most 16 MiB each:
#   drafter.tar.part-NN    the drafter folder drafter/ (config.json, model.safetensors in
#                          bf16, train_log.jsonl, drafter_summary.json), in 15 MiB parts:
#                          cat OUT/drafter.tar.part-* | tar -x -C checkpoints/muse-spark-default/
#   drafter_summary.json   the run's configuration, data, losses and acceptance figures
#   run.log
set -euo pipefail

OUT=${1:?usage: scripts/train_drafter.sh OUT [MINUTES]}
MINUTES=${2:-4}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/muse-drafter}
TARGET=${TARGET:-checkpoints/muse-spark-default}
SEED=${SEED:-0}
METHOD=${METHOD:-dspark}
NUM_LAYERS=${NUM_LAYERS:-1}
LR=${LR:-6e-4}
BATCH_SIZE=${BATCH_SIZE:-32}
NUM_PROMPTS=${NUM_PROMPTS:-8192}
EVAL_PROMPTS=${EVAL_PROMPTS:-256}

export PYTHONPATH=.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG="$OUT/run.log"
rm -rf "$WORK/drafter"

TRAIN=("$PYTHON" -m muse.cli train drafter --target "$TARGET" --out "$WORK/drafter"
       --method "$METHOD" --num-layers "$NUM_LAYERS" --lr "$LR" --batch-size "$BATCH_SIZE"
       --num-prompts "$NUM_PROMPTS" --eval-prompts "$EVAL_PROMPTS" --seed "$SEED"
       --time-budget-minutes "$MINUTES" --device cuda)
# shellcheck disable=SC2206
if [ -n "${EXTRA:-}" ]; then TRAIN+=($EXTRA); fi
echo "+ ${TRAIN[*]}" | tee "$LOG"
"${TRAIN[@]}" 2>&1 | tee -a "$LOG"

tar -c -C "$WORK" drafter | split -b 15M -d -a 2 - "$OUT/drafter.tar.part-"
cp "$WORK/drafter/drafter_summary.json" "$OUT/"
ls -l "$OUT" | tee -a "$LOG"

#!/usr/bin/env bash
# Train the shipped default model (preset muse-spark-default: the decoder with its vision and
# audio encoders) on one GPU, then evaluate it.
#
#   scripts/train_default_model.sh OUT [MINUTES] [EVAL_NUM]
#
# Run from the repository root, with a python3 that has torch, tokenizers, safetensors, jinja2,
# Pillow and soundfile (and matplotlib for the loss plot); muse itself need not be installed.
# The audio task's clips are synthesized with espeak-ng at start: installed, or unpacked from
# .espeak/espeak-ng.tar.xz (scripts/bundle_espeak.sh) on a machine that cannot install it.
# MINUTES (default 7) is the training budget: the whole command (start-up, speech synthesis,
# training, export, evaluation of EVAL_NUM cases per category, default 100) then fits in
# about 10 minutes on an H200.
#
# The full run folder, optimizer state included, goes to $WORK (default /tmp/muse-default).
# SEED (default 0) seeds the weights and the data; BATCH_SIZE (default 32) rows of 1024 tokens;
# LR (default 2e-3) is the peak learning rate; SHARE (default 0.85) the share of each row
# given to conversations (Python source fills the rest); CLIPS (default 16000) spoken clips;
# ENCODER_LR_SCALE (default 1) the encoders' learning rate as a multiple of LR; TASK_WEIGHTS
# (e.g. unseen_tools=0.4,image=0.3) replaces the named conversation tasks' default weights.
# INIT_FROM=checkpoints/muse-spark-default starts from those weights instead (a further stage
# on a fresh machine: the optimizer state does not travel, the checkpoint does; encoders a
# text-only checkpoint lacks start fresh); give it another SEED so the stage sees new data.
# Such a stage is then best averaged with its start (`muse average STAGE START --output
# DIR`): the shipped model is run 18 averaged half and half with run 14 (docs/training.md).
# ENCODER_MINUTES (default 0: none) first trains the encoders alone for that long
# (`muse train encoders`, on labels the generated media carry), from INIT_FROM, and the
# decoder stage then starts from its output and reuses its speech pool.
# SECTIONS (default: every eval section) picks what `muse eval` runs; EVAL_NUM=0 skips it.
# SLIDING_WINDOW=N trains with that window in the decoder's sliding layers (default: the
# preset's). VERDICT_WEIGHT=W weighs the unseen-tool verdict's tokens W times in the loss
# (`--verdict-loss-weight`, default 1).
# GROW_AFTER="1 3 5 7" first grows INIT_FROM by one decoder layer after each named layer
# (`muse grow`: copies whose residual outputs are zero, so the stage starts from INIT_FROM's
# function) into $WORK/grown, and the stage trains at that depth from there.
# COMPILE=1 compiles the decoder layers (`--compile`: a minute or two of compiling, then
# fewer, fused kernels a step).
# A run longer than one command may last: STEPS=N fixes the schedule's length, MINUTES then
# only stops and saves this part, and RESUME=1 continues from $WORK's training state in the
# next command (the machine must still hold $WORK: call again while it is warm; EXPORT=0
# leaves the checkpoint out of OUT, so that the reply comes back at once and the machine is
# still warm for that next command: bringing ~45 MB back took long enough to lose it).
# OUT receives only small files, at most 16 MiB each:
#   checkpoint.tar.part-NN   the shippable checkpoint folder muse-spark-default/ (weights,
#                            config, processor and generation configs, tokenizer + chat
#                            template, training log, loss plot, data manifest, summary), in
#                            15 MiB parts: cat OUT/checkpoint.tar.part-* | tar -x -C checkpoints/
#   loss.png, train_summary.json, eval.json, run.log
set -euo pipefail

OUT=${1:?usage: scripts/train_default_model.sh OUT [MINUTES] [EVAL_NUM]}
MINUTES=${2:-7}
EVAL_NUM=${3:-100}
PYTHON=${PYTHON:-python3}
WORK=${WORK:-/tmp/muse-default}
SEED=${SEED:-0}
LR=${LR:-2e-3}
BATCH_SIZE=${BATCH_SIZE:-32}
SHARE=${SHARE:-0.85}
CLIPS=${CLIPS:-16000}
ENCODER_LR_SCALE=${ENCODER_LR_SCALE:-1}
ENCODER_MINUTES=${ENCODER_MINUTES:-0}
SECTIONS=${SECTIONS:-arithmetic,tools,instructions,python,unseen_tools,vision,video,audio}
MODEL="$WORK/muse-spark-default"
if ! command -v espeak-ng >/dev/null; then
    # shellcheck source=scripts/espeak_env.sh
    source scripts/espeak_env.sh .espeak/espeak-ng.tar.xz  # not the script's own arguments
fi

export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG="$OUT/run.log"

if [ "$ENCODER_MINUTES" != 0 ]; then
    if [ -z "${RESUME:-}" ]; then
        ENCODERS=("$PYTHON" -m muse.cli train encoders --preset muse-spark-default
                  --out "$WORK/encoders" --time-budget-minutes "$ENCODER_MINUTES"
                  --seed "$SEED" --speech-clips "$CLIPS")
        if [ -n "${INIT_FROM:-}" ]; then ENCODERS+=(--init-from "$INIT_FROM"); fi
        echo "+ ${ENCODERS[*]}" | tee "$LOG"
        "${ENCODERS[@]}" 2>&1 | tee -a "$LOG"
        cp "$WORK/encoders/encoder_log.jsonl" "$WORK/encoders/encoder_summary.json" "$OUT/"
        INIT_FROM="$WORK/encoders"
    fi
    # A resumed decoder stage keeps the encoder stage's clips (a run-defining argument).
    SPEECH_POOL="$WORK/encoders/speech_pool.npz"
fi

if [ -n "${GROW_AFTER:-}" ] && [ -z "${RESUME:-}" ]; then
    rm -rf "$WORK/grown"
    # shellcheck disable=SC2086  # the indices are separate arguments
    "$PYTHON" -m muse.cli grow "${INIT_FROM:?GROW_AFTER grows INIT_FROM}" --output "$WORK/grown" \
        --insert-after $GROW_AFTER 2>&1 | tee -a "$LOG"
    INIT_FROM="$WORK/grown"
fi

TRAIN=("$PYTHON" -m muse.cli train pretrain --preset muse-spark-default --out "$MODEL"
       --batch-size "$BATCH_SIZE" --seq-len 1024 --lr "$LR" --warmup-steps 100 --seed "$SEED"
       --time-budget-minutes "$MINUTES" --conversation-share "$SHARE" --speech-clips "$CLIPS"
       --encoder-lr-scale "$ENCODER_LR_SCALE")
if [ -n "${INIT_FROM:-}" ] && [ -z "${RESUME:-}" ]; then TRAIN+=(--init-from "$INIT_FROM"); fi
if [ -n "${SPEECH_POOL:-}" ]; then TRAIN+=(--speech-pool "$SPEECH_POOL"); fi
if [ -n "${STEPS:-}" ]; then TRAIN+=(--schedule-steps "$STEPS"); fi
if [ -n "${TASK_WEIGHTS:-}" ]; then TRAIN+=(--task-weights "$TASK_WEIGHTS"); fi
if [ -n "${RESUME:-}" ]; then TRAIN+=(--resume); fi
if [ -n "${COMPILE:-}" ]; then TRAIN+=(--compile); fi
if [ -n "${SLIDING_WINDOW:-}" ]; then TRAIN+=(--sliding-window "$SLIDING_WINDOW"); fi
if [ -n "${VERDICT_WEIGHT:-}" ]; then TRAIN+=(--verdict-loss-weight "$VERDICT_WEIGHT"); fi
echo "+ ${TRAIN[*]}" | tee -a "$LOG"
"${TRAIN[@]}" 2>&1 | tee -a "$LOG"

# Export before evaluating, so the weights come back even if evaluation is cut short.
if [ "${EXPORT:-1}" != 0 ]; then
    tar -c -C "$WORK" --exclude training_state.pt --exclude '*.partial' muse-spark-default \
        | split -b 15M -d -a 2 - "$OUT/checkpoint.tar.part-"
fi
cp "$MODEL/train_summary.json" "$OUT/"
if [ -f "$MODEL/loss.png" ]; then cp "$MODEL/loss.png" "$OUT/"; fi

if [ "$EVAL_NUM" = 0 ]; then exit 0; fi
EVAL=("$PYTHON" -m muse.cli eval "$MODEL" --num "$EVAL_NUM" --sections "$SECTIONS"
      --json "$OUT/eval.json")
echo "+ ${EVAL[*]}" | tee -a "$LOG"
"${EVAL[@]}" 2>&1 | tee -a "$LOG"

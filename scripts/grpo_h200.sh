#!/usr/bin/env bash
# The GRPO result of docs/training.md: LoRA (rank 32, alpha 64) on the shipped default model,
# trained with GRPO on a held-out task it is weak at, on one GPU, the rollout engine and the
# trainer in one process; then `muse eval` of the base and of the adapter.
#
#   scripts/grpo_h200.sh OUT
#
# The defaults are the shipped adapter's run (docs/training.md, "GRPO on sorting"). TASK
# (default sort), MINUTES (training time, default 6.5), PROMPTS (per step, default 64), GROUP
# (default 8), LR (default 2e-4), MAX_TOKENS (default 120; 4-digit products need 700),
# PASS_AT (--eval-pass-at, default 8), EVAL_SECTIONS (the `muse eval` sections, default
# sorting,instructions,arithmetic), EVAL_NUM (muse eval problems per cell, default 100; 0
# skips it), EVAL_TASKS (the trainer's held-out tasks, default 256), TARGETS (--lora-targets), EVAL_BASE (0 skips the base model's
# eval, for runs that share one) and EXTRA (more `muse train grpo` flags) change the run. Needs
# peft (muse[rl]); on a GPU image without it, install the wheels of
# scripts/fetch_server_wheels.sh first.
set -u
OUT=${1:?usage: scripts/grpo_h200.sh OUT}
PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-checkpoints/muse-spark-default}
TASK=${TASK:-sort}
MINUTES=${MINUTES:-6.5}
PROMPTS=${PROMPTS:-64}
GROUP=${GROUP:-8}
LR=${LR:-2e-4}
MAX_TOKENS=${MAX_TOKENS:-120}
PASS_AT=${PASS_AT:-8}
EVAL_SECTIONS=${EVAL_SECTIONS:-sorting,instructions,arithmetic}
EVAL_NUM=${EVAL_NUM:-100}
EVAL_TASKS=${EVAL_TASKS:-256}
EVAL_BASE=${EVAL_BASE:-1}
EXTRA=${EXTRA:---gpu-memory-utilization 0.3}
# The adapted modules: by default not the routed experts, so that rollout steps with the
# adapter replay the decode CUDA graphs (experts' adapters run eagerly).
TARGETS=${TARGETS:-q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,pooler,unpooler}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

"$PYTHON" -m muse.cli train grpo --model "$MODEL" --task "$TASK" --steps 1000 \
    --max-minutes "$MINUTES" --prompts-per-step "$PROMPTS" --group-size "$GROUP" \
    --max-tokens "$MAX_TOKENS" --lr "$LR" --lora-targets "$TARGETS" --eval-every 5 \
    --eval-tasks "$EVAL_TASKS" --eval-pass-at "$PASS_AT" --seed 0 $EXTRA \
    --output "$OUT/grpo" 2>&1 | tee "$OUT/grpo.log"

if [ "$EVAL_NUM" -gt 0 ] && [ -d "$OUT/grpo/adapter" ]; then
    if [ "$EVAL_BASE" = 1 ]; then
        "$PYTHON" -m muse.cli eval "$MODEL" --sections "$EVAL_SECTIONS" --num "$EVAL_NUM" \
            --json "$OUT/eval-base.json" 2>&1 | tail -20 | tee "$OUT/eval-base.log"
    fi
    "$PYTHON" -m muse.cli eval "$MODEL" --sections "$EVAL_SECTIONS" --num "$EVAL_NUM" \
        --lora "$OUT/grpo/adapter" --json "$OUT/eval-adapter.json" 2>&1 | tail -20 \
        | tee "$OUT/eval-adapter.log"
fi

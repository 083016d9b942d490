#!/usr/bin/env bash
# The multi-GPU runs of docs/performance.md on one host of 2-8 H200s, in parts that each fit
# one device call:
#
#   scripts/multigpu_h200.sh OUT correctness   # every layout's greedy output = one GPU's
#   scripts/multigpu_h200.sh OUT collectives   # all-reduce / all-gather + reduce-scatter /
#                                               # all-to-all at the decode sizes, 2..N ranks
#   scripts/multigpu_h200.sh OUT scaling       # batch-1 decode and 256-request throughput of
#                                               # each layout, and its step's kernels (NCCL
#                                               # included) at batch 1 and 64
#   scripts/multigpu_h200.sh OUT real-size     # full-size layers sharded TP x EP over N GPUs
#
# Run from the repository root with the GPU image's python3 (PYTHONPATH=. is enough). Logs and
# JSON go to OUT (MUSE_COMMIT names the commit in the JSON). NUM_GPUS (default: the GPUs
# visible) bounds the layouts; MODEL (default muse-spark-15b-a2b) is the shape; LAYOUTS (for
# scaling: default "tp2 tp4 tp8 tp8xep dp8xep pp2", cut to NUM_GPUS) names benchmarks/
# parallel_check.py's layouts. NCCL's NVLink multicast (NVLS) stays off: the machines do not
# allow it. A dry run on the CPU (gloo): DEVICE=cpu MODEL=muse-spark-tiny NUM_GPUS=2 and the
# size variables below (each with its default).
set -u
OUT=${1:?usage: scripts/multigpu_h200.sh OUT correctness|collectives|scaling|real-size}
PART=${2:?usage: scripts/multigpu_h200.sh OUT correctness|collectives|scaling|real-size}
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-muse-spark-15b-a2b}
NUM_GPUS=${NUM_GPUS:-$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")}
LAYOUTS=${LAYOUTS:-"tp2 tp4 tp8 tp8xep dp8xep pp2"}
CONTEXT=${CONTEXT:-1024}               # batch-1 prompt tokens
DECODE_TOKENS=${DECODE_TOKENS:-128}
REQUESTS=${REQUESTS:-256}              # throughput requests
LENS=${LENS:-100:1024}                 # their prompt and output lengths
CHECK_PROMPTS=${CHECK_PROMPTS:-16}     # correctness: prompts and tokens per reply
CHECK_TOKENS=${CHECK_TOKENS:-32}
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"

# parallel_check's layout name -> the engine's flags.
flags_of() {
    case $1 in
    tp*xep) local n=${1#tp}; echo "--tensor-parallel-size ${n%xep} --enable-expert-parallel" ;;
    dp*xep) local n=${1#dp}; echo "--data-parallel-size ${n%xep} --enable-expert-parallel" ;;
    tp*xpp*) local tp=${1#tp}; echo "--tensor-parallel-size ${tp%xpp*} --pipeline-parallel-size ${1#*xpp}" ;;
    tp*) echo "--tensor-parallel-size ${1#tp}" ;;
    pp*) echo "--pipeline-parallel-size ${1#pp}" ;;
    dp*) echo "--data-parallel-size ${1#dp}" ;;
    *) echo "unknown layout $1" >&2; return 1 ;;
    esac
}

# A layout's rank count: the product of the numbers in its name.
ranks_of() {
    local product=1 n
    for n in $(echo "$1" | grep -o '[0-9]\+'); do product=$((product * n)); done
    echo $product
}

case $PART in
correctness)
    # Float32: partial sums in another order flip only real near ties (the check's guard).
    "$PYTHON" benchmarks/parallel_check.py --shape "$MODEL" --device "$DEVICE" \
        --num-gpus "$NUM_GPUS" --num-prompts "$CHECK_PROMPTS" --max-tokens "$CHECK_TOKENS" \
        ${PARALLEL_CHECK_ARGS:-} --out "$OUT/parallel-check-$MODEL.json" \
        2>&1 | tee "$OUT/correctness.log"
    ;;
collectives)
    sizes=$(for n in 2 4 8; do [ "$n" -le "$NUM_GPUS" ] && printf '%s,' "$n"; done)
    "$PYTHON" benchmarks/collectives.py --shape "$MODEL" --device "$DEVICE" \
        --world-sizes "${sizes%,}" ${COLLECTIVES_ARGS:-} --out "$OUT/collectives-$MODEL.json" \
        2>&1 | tee "$OUT/collectives.log"
    ;;
scaling)
    for layout in one $LAYOUTS; do
        flags=""
        if [ "$layout" != one ]; then
            [ "$(ranks_of "$layout")" -le "$NUM_GPUS" ] || continue
            flags=$(flags_of "$layout") || exit 1
        fi
        # shellcheck disable=SC2086  # the flags are words
        "$PYTHON" benchmarks/latency.py --shape "$MODEL" --device "$DEVICE" --engines muse \
            --lengths "$CONTEXT" --decode-tokens "$DECODE_TOKENS" --repeats 2 $flags \
            ${LATENCY_ARGS:-} --out "$OUT/latency-$MODEL-$layout.json" \
            > "$OUT/latency-$layout.log" 2>&1 || echo "latency $layout failed"
        # shellcheck disable=SC2086
        "$PYTHON" benchmarks/throughput.py --shape "$MODEL" --device "$DEVICE" --engines muse \
            --num-requests "$REQUESTS" --prompt-lens "$LENS" --output-lens "$LENS" $flags \
            ${THROUGHPUT_ARGS:-} --out "$OUT/throughput-$MODEL-$layout.json" \
            > "$OUT/throughput-$layout.log" 2>&1 || echo "throughput $layout failed"
        for batch in ${PROFILE_BATCHES:-1 64}; do
            # shellcheck disable=SC2086
            "$PYTHON" benchmarks/profile_step.py --shape "$MODEL" --device "$DEVICE" \
                --batch "$batch" --context "$CONTEXT" --modes "${PROFILE_MODES:-graphs}" \
                --top 30 $flags --out "$OUT/profile-$MODEL-$layout-b$batch.json" \
                > "$OUT/profile-$layout-b$batch.log" 2>&1 || echo "profile $layout failed"
        done
        grep -h "^  muse" "$OUT/latency-$layout.log" "$OUT/throughput-$layout.log" \
            | sed "s/^ */$layout: /"
    done
    ;;
real-size)
    # The announced layout: TP x EP over every GPU (bf16, then NVFP4 weights).
    for quant in "" nvfp4-w4a16; do
        "$PYTHON" benchmarks/real_size.py --device "$DEVICE" \
            --tensor-parallel-size "$NUM_GPUS" --enable-expert-parallel \
            ${quant:+--quantization "$quant"} ${REAL_SIZE_ARGS:-} \
            --out "$OUT/real-size-tp${NUM_GPUS}xep${quant:+-$quant}.json" \
            2>&1 | tee "$OUT/real-size${quant:+-$quant}.log"
    done
    ;;
*)
    echo "unknown part $PART: correctness, collectives, scaling or real-size" >&2
    exit 2
    ;;
esac

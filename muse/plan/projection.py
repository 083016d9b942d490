"""Memory per GPU and projected speeds of a model laid out on a GPU fleet.

Memory (exact arithmetic): each GPU's parameters by kind come from `muse.parallel_plan`
(what `muse.layers` creates on a rank); the weight format sets the bytes of the linear
layers (attention, experts, dense MLPs: NVFP4 is 4 bits plus one E4M3 scale per 16, MXFP4
one E8M0 scale per 32, FP8 one byte), while embeddings, the LM head, norms, the router
and the latent pooler stay bf16, as `muse quantize` leaves them. KV from the plan, in the
KV dtype, at the context length.

Speed (a projection, stated here so it can be checked): the largest pipeline stage's GPU is
the model; a data-parallel replica decodes `concurrency / dp` sequences a step.

- Decode step = max(memory time, compute time) + communication time (not overlapped).
  Memory: the weights a step reads (every non-expert weight; of the experts, those the
  step's tokens touch: each of E experts is hit by at least one of B tokens with
  probability 1 - (1 - k/E)^B) plus every sequence's KV at the context length, at the HBM
  bandwidth times `memory_efficiency`. Compute: 2 FLOPs a parameter for each token (experts:
  k of E) plus attention's 4 * context * heads * head_dim a token and layer (sliding layers:
  one window), at the format's dense rate times `compute_efficiency` (FP4 weights on a GPU
  without FP4 tensor cores run at the bf16 rate, W4A16). Communication: two all-reduces of
  the tokens' hidden states a layer over the TP group (ring: 2 (tp - 1) / tp of the bytes
  over one NVLink direction) plus `collective_latency_s` each; pipeline stages run one
  after another (latency, not micro-batched throughput).
- Speculative decoding: a step verifies B * (1 + drafts) tokens and emits B * acceptance.
- Prefill: 2 FLOPs a parameter per token (experts: k of E) plus attention over half the
  context on average, at the dense rate times `compute_efficiency`, plus the same
  all-reduces per layer.

The default efficiencies are what this repository measured on the H200 with proxy shapes
(docs/performance.md): batch-1 decode at 45% of the HBM roofline (Qwen3-30B-A3B shape,
1K context, commit 9cc3543, end to end) and 8K prefill at 47% of the measured 790 TFLOP/s
bf16 rate, 37% of the datasheet 989. `efficiencies_from_layer_timings` takes them instead
from `benchmarks/real_size.py`'s full-size layers measured on the H200 (the layers alone,
without the step's host work: an upper bound on what a whole step reaches).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from muse.config import MuseSparkConfig
from muse.distributed.config import ParallelConfig
from muse.info import DTYPE_BYTES
from muse.parallel_plan import ParallelPlan, StagePlan, parallel_plan
from muse.plan.gpus import GpuSpec

QUANTIZED_KINDS = ("attention", "experts", "dense_mlp")
MEMORY_EFFICIENCY = 0.45
COMPUTE_EFFICIENCY = 0.375
COLLECTIVE_LATENCY_S = 8e-6
ACTIVATION_BYTES = 2  # bf16 hidden states between GPUs


# The H200's datasheet figures, against which a measured fraction becomes an efficiency.
H200_DATASHEET_BANDWIDTH = 4.8e12
H200_DATASHEET_BF16_FLOPS = 989e12


def efficiencies_from_layer_timings(record: dict) -> tuple[float, float]:
    """(memory, compute) efficiency against datasheet figures from a `real_size.py` record:
    the batch-1 decode layer's share of its roofline and the prefill layer's, each scaled
    from the bandwidth and matmul rate the roofline used (measured on the H200) to the
    datasheet's. A layer sharded over N GPUs was measured against N GPUs' roofline."""
    machine, gpus = record["machine"], record.get("gpus", 1)
    decode = record["decode_per_layer"]["1"]["roofline_fraction"]
    prefill = record["prefill_per_layer"]["roofline_fraction"]
    return (min(1.0, decode) * machine["memory_bandwidth_Bps"] / gpus
            / H200_DATASHEET_BANDWIDTH,
            min(1.0, prefill) * machine["matmul_flops"] / gpus / H200_DATASHEET_BF16_FLOPS)


@dataclass(frozen=True)
class WeightFormat:
    linear_bytes: float  # per weight of attention, experts, dense MLPs (scales included)
    compute: str  # the GEMM operand type where the GPU has it: bf16, fp8, fp4


WEIGHT_FORMATS = {
    "bf16": WeightFormat(2.0, "bf16"),
    "fp8": WeightFormat(1.0, "fp8"),
    "nvfp4": WeightFormat(0.5 + 1 / 16, "fp4"),
    "mxfp4": WeightFormat(0.5 + 1 / 32, "fp4"),
}


@dataclass
class Speeds:
    concurrency: int
    sequences_per_replica: int
    step_s: float
    memory_s: float
    compute_s: float
    communication_s: float
    decode_tokens_per_s_per_user: float
    decode_tokens_per_s_per_gpu: float
    prefill_tokens_per_s_per_gpu: float


@dataclass
class Projection:
    gpu: str
    num_gpus: int
    layout: dict[str, int | bool]
    weight_format: str
    kv_dtype: str
    context: int
    weight_bytes_per_gpu: int
    weight_bytes_by_kind: dict[str, int]
    kv_bytes_per_sequence_per_gpu: int
    memory_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int
    sequences_that_fit: int  # per data-parallel replica, at the context length
    fits: bool
    speeds: list[Speeds] = field(default_factory=list)
    assumptions: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def weight_bytes(stage: StagePlan, weight_format: str) -> dict[str, int]:
    """A stage GPU's weight bytes by kind in `weight_format`."""
    linear = WEIGHT_FORMATS[weight_format].linear_bytes
    return {kind: math.ceil(n * (linear if kind in QUANTIZED_KINDS else DTYPE_BYTES["bfloat16"]))
            for kind, n in stage.weight_elements.items()}


def project(config: MuseSparkConfig, parallel: ParallelConfig, gpu: GpuSpec,
            weight_format: str = "bf16", kv_dtype: str = "bfloat16", context: int = 8192,
            concurrency: tuple[int, ...] = (1,), memory_utilization: float = 0.9,
            memory_efficiency: float = MEMORY_EFFICIENCY,
            compute_efficiency: float = COMPUTE_EFFICIENCY,
            num_speculative_tokens: int = 0, acceptance_length: float = 1.0) -> Projection:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {sorted(WEIGHT_FORMATS)}, got "
                         f"{weight_format!r}")
    if not 1.0 <= acceptance_length <= num_speculative_tokens + 1:
        raise ValueError("the acceptance length must be between 1 and the drafts + 1")
    plan = parallel_plan(config, parallel, context, "bfloat16", kv_dtype)
    stage = plan.stages[plan.largest_stage]
    by_kind = weight_bytes(stage, weight_format)
    weights = sum(by_kind.values())
    memory = int(gpu.memory_gb * 1e9)
    budget = int(memory * memory_utilization) - weights
    fits_sequences = max(0, budget) // stage.kv_bytes_per_sequence
    projection = Projection(
        gpu=gpu.name, num_gpus=parallel.world_size,
        layout={"tensor_parallel_size": parallel.tensor_parallel_size,
                "pipeline_parallel_size": parallel.pipeline_parallel_size,
                "data_parallel_size": parallel.data_parallel_size,
                "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
                "enable_expert_parallel": parallel.enable_expert_parallel},
        weight_format=weight_format, kv_dtype=kv_dtype, context=context,
        weight_bytes_per_gpu=weights, weight_bytes_by_kind=by_kind,
        kv_bytes_per_sequence_per_gpu=stage.kv_bytes_per_sequence,
        memory_bytes_per_gpu=memory, kv_budget_bytes_per_gpu=budget,
        sequences_that_fit=fits_sequences, fits=budget > 0 and fits_sequences > 0,
        assumptions={"memory_efficiency": memory_efficiency,
                     "compute_efficiency": compute_efficiency,
                     "collective_latency_s": COLLECTIVE_LATENCY_S,
                     "memory_utilization": memory_utilization,
                     "num_speculative_tokens": num_speculative_tokens,
                     "acceptance_length": acceptance_length})
    for level in concurrency:
        projection.speeds.append(_speeds(config, plan, stage, gpu, weight_format, by_kind,
                                         context, level, memory_efficiency,
                                         compute_efficiency, num_speculative_tokens,
                                         acceptance_length))
    return projection


def _speeds(config: MuseSparkConfig, plan: ParallelPlan, stage: StagePlan, gpu: GpuSpec,
            weight_format: str, by_kind: dict[str, int], context: int, concurrency: int,
            memory_efficiency: float, compute_efficiency: float, drafts: int,
            acceptance: float) -> Speeds:
    text = config.text_config
    sequences = math.ceil(concurrency / plan.data_parallel_size)
    tokens = sequences * (1 + drafts)  # verified a step
    k, num_experts = text.num_experts_per_tok, max(text.num_experts, 1)
    touched = 1 - (1 - k / num_experts) ** tokens if text.num_experts else 1.0
    lm_head = plan.shards.vocab_rows * text.hidden_size  # this GPU's rows of it
    read = (by_kind["attention"] + by_kind["dense_mlp"] + by_kind["other"]
            + (lm_head * DTYPE_BYTES["bfloat16"] if stage.holds_lm_head else 0)
            + by_kind["experts"] * touched
            + sequences * stage.kv_bytes_per_sequence)
    memory_s = read / (gpu.hbm_tb_s * 1e12 * memory_efficiency)

    elements = stage.weight_elements
    dense_params = elements["attention"] + elements["dense_mlp"] + elements["other"] \
        + (lm_head if stage.holds_lm_head else 0)
    # Each token's k experts are spread over the E experts; this GPU holds E_local of them.
    expert_params = elements["experts"] * k / num_experts if text.num_experts else 0
    heads = plan.shards.num_heads
    window = min(context, text.sliding_window or context)
    attention_context = (stage.layers_global * context + stage.layers_sliding * window)
    rate = gpu.matmul_tflops(WEIGHT_FORMATS[weight_format].compute) * 1e12 * compute_efficiency
    flops_per_token = 2 * (dense_params + expert_params) \
        + 4 * attention_context * heads * text.head_dim
    compute_s = tokens * flops_per_token / rate
    tp = plan.tensor_parallel_size
    per_layer = _all_reduce_s(tokens * text.hidden_size * ACTIVATION_BYTES, tp, gpu)
    communication_s = 2 * stage.num_layers * per_layer
    stage_s = max(memory_s, compute_s) + communication_s
    step_s = stage_s * plan.pipeline_parallel_size
    gpus_per_replica = plan.world_size // plan.data_parallel_size
    emitted = sequences * acceptance
    # Prefill: a token's share of this GPU's compute (attention over half the context on
    # average) and of its all-reduce bytes; pipeline stages work on different tokens at once.
    prefill_flops = 2 * (dense_params + expert_params) + 4 * heads * text.head_dim * (
        stage.layers_global * context / 2 + stage.layers_sliding * min(window, context / 2))
    prefill_token_s = prefill_flops / rate + 2 * stage.num_layers * 2 * (tp - 1) / tp \
        * text.hidden_size * ACTIVATION_BYTES / (gpu.nvlink_gb_s * 1e9)
    return Speeds(
        concurrency=concurrency, sequences_per_replica=sequences, step_s=step_s,
        memory_s=memory_s, compute_s=compute_s, communication_s=communication_s,
        decode_tokens_per_s_per_user=acceptance / step_s,
        decode_tokens_per_s_per_gpu=emitted / step_s / gpus_per_replica,
        prefill_tokens_per_s_per_gpu=1 / prefill_token_s / gpus_per_replica)


def _all_reduce_s(nbytes: float, ranks: int, gpu: GpuSpec) -> float:
    if ranks == 1:
        return 0.0
    return COLLECTIVE_LATENCY_S + 2 * (ranks - 1) / ranks * nbytes / (gpu.nvlink_gb_s * 1e9)


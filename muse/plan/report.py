"""`muse plan`'s table."""

from __future__ import annotations

from muse.info import human_bytes
from muse.parallel_plan import KIND_LABELS
from muse.plan.projection import Projection


def format_projection(projection: Projection) -> str:
    layout = projection.layout
    lines = [
        f"{projection.num_gpus} x {projection.gpu}: TP {layout['tensor_parallel_size']} x "
        f"PP {layout['pipeline_parallel_size']} x DP {layout['data_parallel_size']} x "
        f"PCP {layout['prefill_context_parallel_size']}"
        + (", experts over EP" if layout["enable_expert_parallel"] else "")
        + f"; weights {projection.weight_format}, KV {projection.kv_dtype}, context "
        f"{projection.context:,} tokens",
        "per GPU (the largest pipeline stage's):",
        f"  weights {human_bytes(projection.weight_bytes_per_gpu)}",
    ]
    lines += [f"    {KIND_LABELS[kind]:<30} {human_bytes(n)}"
              for kind, n in projection.weight_bytes_by_kind.items() if n]
    lines += [
        f"  KV of one sequence {human_bytes(projection.kv_bytes_per_sequence_per_gpu)}",
        f"  memory {human_bytes(projection.memory_bytes_per_gpu)}, KV budget "
        f"{human_bytes(max(0, projection.kv_budget_bytes_per_gpu))}: "
        + (f"fits, {projection.sequences_that_fit:,} sequences of this context per replica"
           if projection.fits else "DOES NOT FIT"),
        "projected (see `muse/plan/projection.py` for the model; efficiencies "
        f"{projection.assumptions['memory_efficiency']:.2f} of HBM, "
        f"{projection.assumptions['compute_efficiency']:.2f} of the dense rate):",
        f"  {'concurrency':>11} {'decode tok/s/user':>18} {'decode tok/s/GPU':>17} "
        f"{'step ms':>8} {'(mem':>6} {'compute':>8} {'comm)':>6} {'prefill tok/s/GPU':>18}",
    ]
    for s in projection.speeds:
        lines.append(
            f"  {s.concurrency:>11,} {s.decode_tokens_per_s_per_user:>18,.0f} "
            f"{s.decode_tokens_per_s_per_gpu:>17,.0f} {s.step_s * 1e3:>8.2f} "
            f"{s.memory_s * 1e3:>6.2f} {s.compute_s * 1e3:>8.2f} "
            f"{s.communication_s * 1e3:>6.2f} {s.prefill_tokens_per_s_per_gpu:>18,.0f}")
    return "\n".join(lines)

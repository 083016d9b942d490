"""The routed experts of a latent MoE layer as one fused computation.

`fused_experts_torch` and `fused_experts_triton` compute what `LatentMoE` computes between its
pooler and unpooler,

    out[t] = sum_j weights[t, j] * norm_e(down_e @ swiglu(gate_up_e @ x[t])),  e = ids[t, j]

accumulated in float32 (norm_e: the expert's own RMSNorm, when the layer has one). The Triton
path (the "triton" MoE backend, see `muse.kernels.backends`) never asks the host for a value,
so a decode step that contains it can be captured in a CUDA graph; the plain PyTorch twin
(the "torch" backend) is also the tests' oracle.

Data flow of the Triton path (the T*k (token, slot) pairs are "pairs"; pair p = t*k + j):

1. align (`align_pairs`, torch ops of static shapes):
   sort the pairs by expert and pad each expert's run to a multiple of BLOCK_M, so
   every BLOCK_M-row block belongs to one expert.
   Out come `sorted_pairs` (padding rows hold the sentinel T*k) and `block_expert` (-1 for
   blocks past the end). Sizes are worst-case bounds computed from shapes alone.
2. GEMM 1 + SwiGLU: per (block, intermediate tile), gather rows x[pair // k], multiply by the
   gate and the up rows of gate_up[e], write silu(gate) * up as h in the activation dtype.
3. GEMM 2: y[pair] = h @ down[e]^T, in float32.
4. combine, one program per token: RMSNorm of each slot's y row times norm_weight[e], times the
   routing weight, summed over the k slots, written in x's dtype.

Between steps 3 and 4 an optional `reduce_pairs` hook may replace y (float32 [T*k, L], pair
order). Tensor parallelism splits each expert's intermediate width over ranks, so every rank's
y is a partial sum of the down projection; the expert's RMSNorm is not linear, so those
partials must be summed (all-reduced) per pair before the norm, not after the combine.

At decode sizes (T*k <= min(64, E), or up to 64 over experts small enough to stay in L2;
`moe_triton.use_one_pair_per_block`) step 1 is skipped:
each pair is an M block of its own, whose expert the GEMMs read from expert_ids directly, so the
call is three kernel launches and nothing else.

FP4 experts (W4A16): `gate_up` and / or `down` may be `muse.kernels.w4a16.Fp4Weight`s (NVFP4
or MXFP4, packed [E, 2I, L/2] and [E, L, I/2] with their block scales and per-row factors).
The Triton GEMMs then read the packed bytes and scales and form each weight tile in the
activation dtype in registers (a compile-time switch of the same kernels, so both modes
above work unchanged); the twin dequantizes the weights and runs as for dense ones.

FP8 experts (W8A16) likewise: `muse.kernels.w8a16.Fp8Weight`s (float8_e4m3fn [E, 2I, L] and
[E, L, I] with one float32 scale per output row). The GEMMs read the FP8 bytes and scale each
weight tile into the activation dtype inside their K loop; no dequantized copy of the experts
is made.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from muse.kernels.moe_align import PairReduce
from muse.kernels.w4a16 import Fp4Weight, dense_weight
from muse.kernels.w8a16 import Fp8Weight

# A stacked-experts weight as both experts paths take it: dense in the activation dtype, FP4 or
# FP8 (gate_up and down each on its own).
ExpertWeight = torch.Tensor | Fp4Weight | Fp8Weight
# (rows, expert, "gate_up" | "down") -> the rows that projection multiplies.
ActivationHook = Callable[[torch.Tensor, int, str], torch.Tensor]
# (out float32 rows, their input rows, pair ids, top_k, expert, "gate_up" | "down"): adds a
# LoRA adapter's deltas to a projection's output in place (`muse.lora.layers.ExpertsLoRA`).
LoRAHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int, str], None]


def fused_experts_torch(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                        gate_up: ExpertWeight, down: ExpertWeight,
                        norm_weight: torch.Tensor | None, eps: float,
                        reduce_pairs: PairReduce | None = None,
                        activations: ActivationHook | None = None,
                        lora: LoRAHook | None = None) -> torch.Tensor:
    """The plain PyTorch twin of `fused_experts_triton`, one matmul pair per used expert.

    It rounds where the kernels round: h in the activation dtype, everything after the second
    matmul in float32. It asks the host for the per-expert counts once, so it is not capturable.
    FP4 and FP8 experts are dequantized and rounded to the activation dtype first.
    `activations(rows, expert, projection)`, when given, replaces each expert's input rows
    ("gate_up") and its h ("down") before their matmul (emulated activation quantization).
    `lora`, when given, adds each pair's adapter delta to both projections' outputs (before
    the SwiGLU and before the expert norm, where the adapted weights would act).
    """
    gate_up, down = dense_weight(gate_up, x.dtype), dense_weight(down, x.dtype)
    num_tokens, top_k = expert_ids.shape
    inter = down.shape[2]
    flat = expert_ids.reshape(-1)
    # Pairs grouped by expert; a stable sort keeps each expert's tokens in order.
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    y = torch.zeros(flat.numel(), x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        rows = x[pairs // top_k]
        if activations is not None:
            rows = activations(rows, expert, "gate_up")
        gate_up_out = (rows @ gate_up[expert].t()).float()
        if lora is not None:
            lora(gate_up_out, rows, pairs, top_k, expert, "gate_up")
        h = (F.silu(gate_up_out[:, :inter]) * gate_up_out[:, inter:]).to(x.dtype)
        if activations is not None:
            h = activations(h, expert, "down")
        down_out = (h @ down[expert].t()).float()
        if lora is not None:
            lora(down_out, h, pairs, top_k, expert, "down")
        y[pairs] = down_out
    if reduce_pairs is not None:
        y = reduce_pairs(y)
    if norm_weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
        y = y * norm_weight[flat].float()
    out = (y.view(num_tokens, top_k, x.shape[1]) * weights.float()[..., None]).sum(1)
    return out.to(x.dtype)


def fused_experts_triton(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                         gate_up: ExpertWeight, down: ExpertWeight,
                         norm_weight: torch.Tensor | None, eps: float,
                         one_pair_per_block: bool | None = None,
                         reduce_pairs: PairReduce | None = None) -> torch.Tensor:
    """The Triton path: no host synchronisation, static shapes, CUDA-graph capturable.

    one_pair_per_block: None lets the number of pairs choose between the aligned path and the
    alignment-free decode mode; True / False force one of them.
    """
    # Imported here so that the CPU path works where Triton is not installed.
    from muse.kernels import moe_triton

    return moe_triton.fused_experts(x, weights, expert_ids, gate_up, down, norm_weight, eps,
                                    one_pair_per_block=one_pair_per_block,
                                    reduce_pairs=reduce_pairs)

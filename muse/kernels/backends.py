"""The kernels a model runs with, chosen once when the model is built.

Two small registries, attention and MoE, map a backend name to its functions. "torch" is the
plain PyTorch twins (any device: the oracle the kernels are tested against); "triton" is the
Triton kernels (CUDA). Norms and rotary follow the attention backend. "auto" picks Triton on
CUDA and the twins elsewhere. Later backends (a Hopper attention kernel, a persistent MoE
kernel) register here by name and are chosen with `--attention-backend` / `--moe-backend`;
the model never looks at a tensor's device to decide. An FP8 KV cache is not a backend: both
attention backends store and read FP8 caches, with the layer's scales.

Triton modules are imported only when a Triton backend is chosen, so CPU-only processes never
import Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

AUTO = "auto"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable  # (k_cache, v_cache, k, v, slot_mapping, k_scale, v_scale)
    # (q, k_cache, v_cache, meta, kind, window, scale, k_scale, v_scale, new_kv=None) -> out
    paged_attention: Callable
    qk_norm_rope: Callable  # (q, k, q_weight, k_weight, cos, sin, eps) -> (q, k)
    rms_norm: Callable  # (x, weight, eps) -> normed
    add_rms_norm: Callable  # (x, residual, weight, eps) -> (normed, x + residual)


@dataclass(frozen=True)
class MoEBackend:
    name: str
    route_topk: Callable  # (router_logits, top_k, scoring, normalize) -> (weights, ids)
    fused_experts: Callable  # see muse.kernels.moe.fused_experts


def _torch_attention() -> AttentionBackend:
    from muse.kernels.norms import add_rms_norm_torch, rms_norm_torch
    from muse.kernels.paged_attention import paged_attention, write_kv
    from muse.kernels.rotary import qk_norm_rope_torch

    return AttentionBackend("torch", write_kv, paged_attention, qk_norm_rope_torch,
                            rms_norm_torch, add_rms_norm_torch)


def _triton_attention() -> AttentionBackend:
    from muse.kernels.kv_write import write_kv_triton
    from muse.kernels.norms_triton import add_rms_norm_triton, rms_norm_triton
    from muse.kernels.paged_attention_triton import paged_attention_triton
    from muse.kernels.rotary import qk_norm_rope

    return AttentionBackend("triton", write_kv_triton, paged_attention_triton,
                            qk_norm_rope, rms_norm_triton, add_rms_norm_triton)


def _torch_moe() -> MoEBackend:
    from muse.kernels.moe import fused_experts_torch
    from muse.kernels.routing import route_topk_torch

    return MoEBackend("torch", route_topk_torch, fused_experts_torch)


def _triton_moe() -> MoEBackend:
    from muse.kernels.moe_triton import fused_experts
    from muse.kernels.routing_triton import route_topk_triton

    return MoEBackend("triton", route_topk_triton, fused_experts)


ATTENTION_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch_attention, "triton": _triton_attention}
MOE_BACKENDS: dict[str, Callable[[], MoEBackend]] = {"torch": _torch_moe, "triton": _triton_moe}


@dataclass(frozen=True)
class ModelBackends:
    attention: AttentionBackend
    moe: MoEBackend


def _resolve(name: str, registry: dict, what: str, device: torch.device) -> str:
    if name == AUTO:
        return "triton" if device.type == "cuda" else "torch"
    if name not in registry:
        raise ValueError(f"`{what}` must be {AUTO!r} or one of {sorted(registry)}, got {name!r}")
    if name == "triton" and device.type != "cuda":
        raise ValueError(f"the {what} {name!r} needs a CUDA device; this model is on "
                         f"{device}: use 'torch' or 'auto'")
    return name


def select_backends(device: torch.device, attention: str = AUTO, moe: str = AUTO
                    ) -> ModelBackends:
    """The backends for a model on `device` (names from the registries, or "auto")."""
    attention = _resolve(attention, ATTENTION_BACKENDS, "attention_backend", device)
    moe = _resolve(moe, MOE_BACKENDS, "moe_backend", device)
    return ModelBackends(ATTENTION_BACKENDS[attention](), MOE_BACKENDS[moe]())

"""Engine attention: the reference projections and norms, with K/V kept in the paged cache.

On CUDA the q/k norm and rotary run as one Triton kernel and attention as the paged Triton
kernels; elsewhere their plain-torch twins, which the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from muse.engine.metadata import BatchMetadata
from muse.kernels.paged_attention import paged_attention, write_kv
from muse.kernels.rotary import qk_norm_rope
from muse.reference.layers import AttentionProjections


def _kernels(device: torch.device):
    """(write_kv, paged_attention) for tensors on `device`: Triton on CUDA, else the twins."""
    if device.type == "cuda":
        from muse.kernels.kv_write import write_kv_triton
        from muse.kernels.paged_attention_triton import paged_attention_triton

        return write_kv_triton, paged_attention_triton
    return write_kv, paged_attention


class PagedAttention(AttentionProjections):
    fused_qkv: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        """Stack q/k/v weights into one matrix (one GEMM instead of three per step); the three
        parameters become views of it, so names, loading and memory stay as they were."""
        if self.q_proj.bias is not None:
            return
        projections = (self.q_proj, self.k_proj, self.v_proj)
        fused = torch.cat([p.weight.detach() for p in projections])
        start = 0
        for projection in projections:
            rows = projection.weight.shape[0]
            projection.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
            start += rows
        self.fused_qkv = fused

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.fused_qkv is None:
            return super().project(x)
        q_width = self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = F.linear(x, self.fused_qkv).split([q_width, kv_width, kv_width], dim=-1)
        lead = x.shape[:-1]
        return (q.view(*lead, self.num_heads, self.head_dim),
                k.view(*lead, self.num_kv_heads, self.head_dim),
                v.view(*lead, self.num_kv_heads, self.head_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.project(x)
        q_norm, k_norm = self.q_norm, self.k_norm
        eps = q_norm.eps if q_norm is not None else 0.0
        q, k = qk_norm_rope(q, k, q_norm.weight if q_norm is not None else None,
                            k_norm.weight if k_norm is not None else None, cos, sin, eps)
        kind = meta.kinds[self.layer_type]
        k_cache, v_cache = kv_cache
        store, attend = _kernels(q.device)
        store(k_cache, v_cache, k, v, kind.slot_mapping)
        out = attend(q, k_cache, v_cache, meta, kind, self.sliding_window, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

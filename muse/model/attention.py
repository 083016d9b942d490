"""Engine attention: the reference projections and norms, with K/V kept in the paged cache."""

from __future__ import annotations

import torch

from muse.engine.metadata import BatchMetadata
from muse.kernels.paged_attention import paged_attention, write_kv
from muse.reference.layers import AttentionProjections


class PagedAttention(AttentionProjections):
    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        kind = meta.kinds[self.layer_type]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, kind.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, kind, self.sliding_window, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))

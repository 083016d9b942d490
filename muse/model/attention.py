"""Engine attention: the reference projections and norms, with K/V kept in the paged cache."""

from __future__ import annotations

import math

import torch
from torch import nn

from muse.config import TextConfig
from muse.engine.metadata import BatchMetadata
from muse.kernels.paged_attention import paged_attention, write_kv
from muse.reference.layers import RMSNorm
from muse.reference.rope import apply_rotary


class PagedAttention(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.sliding_window = config.layer_window(layer_index)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        bias = config.attention_bias
        hidden, q_width = config.hidden_size, self.num_heads * self.head_dim
        kv_width = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_width, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        kind = meta.kinds[self.layer_type]
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, kind.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, kind, self.sliding_window, self.scale)
        return self.o_proj(out.reshape(tokens, -1))

"""Engine attention: fused q/k/v projection, per-head q/k norm + rotary, paged K/V cache.

Heads are split over tensor-parallel ranks by `QKVParallelLinear` (each rank keeps the K/V
heads its query heads read, replicated when there are more ranks than K/V heads) and summed
back by `o_proj`, a `RowParallelLinear`. With prefill context parallelism each rank projects
its own slice of the step's tokens, and the slices' K/V are all-gathered before the cache
write (see `ContextParallelMetadata`). The kernels come from the attention backend chosen
when the model was built.

FP8 KV cache: `k_scale` / `v_scale` are float32 device buffers of one entry per kv head this
rank holds (a per-tensor scale fills them all), passed to the kernels with every call, which
use them only when the cache is FP8. They come from the checkpoint (`load_kv_scale`), from the
first step's K/V (`calculate_kv_scales`), or stay 1.0. Being buffers that only change in
place, a CUDA graph captured before they are set reads their later values.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from muse.config import TextConfig
from muse.distributed.parallel_state import get_pcp_group
from muse.kernels.attention_metadata import BatchMetadata
from muse.kernels.backends import AttentionBackend
from muse.layers.linear import QKVParallelLinear, RowParallelLinear
from muse.layers.quantization import QuantizationConfig
from muse.layers.norm import RMSNorm

# `--calculate-kv-scales`: scale = amax / divisor over the first step's K (V), as vLLM computes
# them (its K_SCALE_CONSTANT / V_SCALE_CONSTANT). Below FP8's 448, so later tokens up to 2.2x
# (K) and 4.5x (V) that step's largest value still fit: the scales are fixed afterwards.
K_SCALE_DIVISOR = 200.0
V_SCALE_DIVISOR = 100.0


class EngineAttention(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int, backend: AttentionBackend,
                 params_dtype: torch.dtype, prefix: str,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.layer_type = config.layer_types[layer_index]
        self.sliding_window = config.layer_window(layer_index)
        self.head_dim = config.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads,
            config.num_key_value_heads, bias=config.attention_bias, params_dtype=params_dtype,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim,
                                        config.hidden_size, bias=False,
                                        params_dtype=params_dtype, quant_config=quant_config,
                                        prefix=f"{prefix}.o_proj")
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, params_dtype,
                                  f"{prefix}.q_norm")
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, params_dtype,
                                  f"{prefix}.k_norm")
        else:
            self.q_norm = self.k_norm = None
        # Not parameters: a checkpoint without scales is complete (they stay 1.0).
        self.register_buffer("k_scale", torch.ones(self.num_kv_heads, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("v_scale", torch.ones(self.num_kv_heads, dtype=torch.float32),
                             persistent=False)
        # Set for one step by `EngineModel.calculate_kv_scales_on_next_step`.
        self.calculate_kv_scales = False

    def load_kv_scale(self, name: str, loaded: torch.Tensor) -> None:
        """`name` "k_scale" or "v_scale": a checkpoint scale, one value (per tensor) or one per
        kv head of the model ([num_key_value_heads]; this rank takes its heads')."""
        target = {"k_scale": self.k_scale, "v_scale": self.v_scale}[name]
        values = loaded.detach().float().flatten()
        qkv = self.qkv_proj
        if values.numel() == qkv.total_num_kv_heads and values.numel() > 1:
            first = qkv.tp_rank // qkv.num_kv_head_replicas * self.num_kv_heads
            values = values[first:first + self.num_kv_heads]
        elif values.numel() != 1:
            raise ValueError(f"a {name} of shape {tuple(loaded.shape)}: expected one value or "
                             f"one per kv head ({qkv.total_num_kv_heads})")
        if not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"{name} must be positive and finite, got {values.tolist()}")
        target.copy_(values.expand_as(target))

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's K/V amax sets the scales, on the device (no host sync). A K or V of
        zeros keeps 1.0."""
        for target, values, divisor in ((self.k_scale, k, K_SCALE_DIVISOR),
                                        (self.v_scale, v, V_SCALE_DIVISOR)):
            amax = values.abs().amax().float()
            target.copy_(torch.where(amax > 0, amax / divisor, 1.0).expand_as(target))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q and k (normed per head and rotated) and v of the step's tokens: the part of the
        block that reads no metadata (piecewise graphs capture it). The layer applies
        `o_proj` to `attend`'s output."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q_norm, k_norm = self.q_norm, self.k_norm
        q, k = self.backend.qk_norm_rope(
            q, k, q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None, cos, sin,
            q_norm.eps if q_norm is not None else 0.0)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """K/V stored in the cache and the queries' attention over it, [tokens, heads x
        head_dim] (`o_proj`'s input): the part that reads the step's metadata."""
        kind = meta.kinds[self.layer_type]
        k_cache, v_cache = kv_cache
        slots, context = kind.slot_mapping, meta.context_parallel
        if context is not None:
            # This rank's queries attend to keys of the other ranks' slices too.
            group = get_pcp_group()
            k = group.all_gather_rows(k, context.num_tokens)
            v = group.all_gather_rows(v, context.num_tokens)
            slots = context.slot_mappings[self.layer_type]
        if self.calculate_kv_scales:
            self._calculate_kv_scales(k, v)
        self.backend.write_kv(k_cache, v_cache, k, v, slots, self.k_scale, self.v_scale)
        out = self.backend.paged_attention(q, k_cache, v_cache, meta, kind, self.sliding_window,
                                           self.scale, self.k_scale, self.v_scale,
                                           new_kv=(k, v) if context is None else None)
        return out.reshape(q.shape[0], -1)

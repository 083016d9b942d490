"""The engine's decoder: its own layers over a flat batch of tokens and a paged KV cache.

Built from `muse.layers`, which own how their parameters are sharded and loaded, with the
kernels of the backends chosen at build time (`muse.kernels.backends`). Parameter names are
the checkpoint's, except where projections are fused (`qkv_proj`, `gate_up_proj`); the loader
(`muse.model.loader`) routes checkpoint tensors to them. The residual stream is carried beside
the layer output, so each norm also does the residual add before it in one kernel. The
reference decoder (`muse.reference`) computes the same function and is the tests' oracle.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.kernels.attention_metadata import BatchMetadata
from muse.kernels.backends import ModelBackends
from muse.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from muse.layers.norm import RMSNorm
from muse.model.attention import EngineAttention
from muse.model.moe import EngineMLP, EngineMoE
from muse.rope import cos_sin, inverse_frequencies

Rotary = dict[str, tuple[torch.Tensor, torch.Tensor]]


class EngineDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int, backends: ModelBackends,
                 params_dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.norms = backends.attention
        self.layer_type = config.layer_types[layer_index]
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, params_dtype,
                                       f"{prefix}.input_layernorm")
        self.self_attn = EngineAttention(config, layer_index, backends.attention, params_dtype,
                                         f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, params_dtype,
                                                f"{prefix}.post_attention_layernorm")
        self.mlp = EngineMoE(config, backends.moe, params_dtype, f"{prefix}.mlp") \
            if config.is_moe else EngineMLP(config.hidden_size, config.intermediate_size,
                                            params_dtype, f"{prefix}.mlp")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): their sum is the reference layer's output.

        `residual` is None for the first layer, whose input is the whole residual stream."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, self.norms.rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = self.norms.add_rms_norm(x, residual, norm.weight, norm.eps)
        cos, sin = rotary[self.layer_type]
        h = self.self_attn(h, cos, sin, meta=meta, kv_cache=kv_cache)
        norm = self.post_attention_layernorm
        h, residual = self.norms.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


class EngineModel(nn.Module):
    def __init__(self, config: TextConfig, backends: ModelBackends,
                 params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        self.norms = backends.attention
        dtype = params_dtype or torch.get_default_dtype()
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                         params_dtype=dtype,
                                                         prefix="model.embed_tokens")
        self.model.layers = nn.ModuleList(
            EngineDecoderLayer(config, i, backends, dtype, f"model.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, "model.norm")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype,
                                      prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self._rope = {kind: inverse_frequencies(config.rope_parameters[kind], config.head_dim)
                      for kind in LAYER_TYPES}
        self._rope_on_device: dict[torch.device, dict[str, tuple[torch.Tensor, float]]] = {}

    @property
    def num_kv_heads(self) -> int:
        """K/V heads each layer keeps on this rank (the KV cache's width)."""
        return self.model.layers[0].self_attn.num_kv_heads

    def rotary(self, positions: torch.Tensor) -> Rotary:
        # The frequencies move to the device once: a copy from the host cannot sit inside a
        # captured CUDA graph, and the first (eager) step on a device fills this cache.
        rope = self._rope_on_device.get(positions.device)
        if rope is None:
            rope = {kind: (inv_freq.to(positions.device), scale)
                    for kind, (inv_freq, scale) in self._rope.items()}
            self._rope_on_device[positions.device] = rope
        return {kind: cos_sin(positions, inv_freq, scale)
                for kind, (inv_freq, scale) in rope.items()}

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (before the last norm) of the step's tokens, [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary(meta.positions)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(x, residual, rotary, meta=meta, kv_cache=kv_cache)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = self.model.norm
        return self.lm_head(self.norms.rms_norm(hidden, norm.weight, norm.eps)).float()

"""The engine's decoder: the reference network over a flat batch of tokens and a paged cache.

Parameter names are the reference model's (the checkpoint layout), so one loader fills both.
Only attention differs: it reads and writes the paged KV cache through `BatchMetadata`.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.engine.metadata import BatchMetadata
from muse.model.attention import PagedAttention
from muse.reference.layers import DenseMLP, LatentMoE, RMSNorm
from muse.reference.rope import cos_sin, inverse_frequencies


class EngineDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = PagedAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LatentMoE(config) if config.is_moe else DenseMLP(config.hidden_size,
                                                                    config.intermediate_size)

    def forward(self, x: torch.Tensor, rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        cos, sin = rotary[self.layer_type]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class EngineModel(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(EngineDecoderLayer(config, i)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope = {kind: inverse_frequencies(config.rope_parameters[kind], config.head_dim)
                      for kind in LAYER_TYPES}

    def rotary(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {kind: cos_sin(positions, inv_freq, scale)
                for kind, (inv_freq, scale) in self._rope.items()}

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states (before the last norm) of the step's tokens, [tokens, hidden]."""
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = self.rotary(meta.positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rotary, meta, kv_cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

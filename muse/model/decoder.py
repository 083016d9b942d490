"""The engine's decoder: the reference network over a flat batch of tokens and a paged cache.

The layers are the reference's `DecoderLayer`s (same parameter names, the checkpoint layout, so
one loader fills both). What differs: attention reads and writes the paged KV cache through
`BatchMetadata`; the MoE runs the fused expert kernels; and the residual stream is carried
beside the layer output, so each norm also does the residual add before it in one kernel.
Every step is a kernel on CUDA and its plain-torch twin elsewhere (`muse.kernels`).
"""

from __future__ import annotations

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.engine.metadata import BatchMetadata
from muse.kernels.norms import add_rms_norm, rms_norm
from muse.model.attention import PagedAttention
from muse.model.moe import EngineMoE
from muse.reference.layers import RMSNorm
from muse.reference.model import DecoderLayer
from muse.reference.rope import cos_sin, inverse_frequencies

Rotary = dict[str, tuple[torch.Tensor, torch.Tensor]]


class EngineDecoderLayer(DecoderLayer):
    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__(config, layer_index, attention=PagedAttention, moe=EngineMoE)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): their sum is the reference layer's output.

        `residual` is None for the first layer, whose input is the whole residual stream."""
        norm = self.input_layernorm
        if residual is None:
            residual, h = x, rms_norm(x, norm.weight, norm.eps)
        else:
            h, residual = add_rms_norm(x, residual, norm.weight, norm.eps)
        cos, sin = rotary[self.layer_type]
        h = self.self_attn(h, cos, sin, meta=meta, kv_cache=kv_cache)
        norm = self.post_attention_layernorm
        h, residual = add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h), residual


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
        self._rope_on_device: dict[torch.device, dict[str, tuple[torch.Tensor, float]]] = {}

    def fuse_projections(self) -> None:
        """Once the weights are in place: merge projections that read the same input."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()

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
        return self.lm_head(rms_norm(hidden, norm.weight, norm.eps)).float()

"""The engine's decoder: the reference network over a flat batch of tokens and a paged cache.

The layers are the reference's `DecoderLayer`s (same parameter names, the checkpoint layout, so
one loader fills both); only attention differs: it reads and writes the paged KV cache through
`BatchMetadata`.
"""

from __future__ import annotations

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.engine.metadata import BatchMetadata
from muse.model.attention import PagedAttention
from muse.reference.layers import RMSNorm
from muse.reference.model import DecoderLayer
from muse.reference.rope import cos_sin, inverse_frequencies


class EngineModel(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(config, i, attention=PagedAttention)
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
            x = layer(x, rotary, meta=meta, kv_cache=kv_cache)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).float()

"""The reference Muse Spark text decoder: plain PyTorch, whole sequences, no cache.

It is the oracle the engine is tested against and the model that training differentiates,
so every step is written the obvious way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.reference.layers import Attention, DenseMLP, LatentMoE, RMSNorm
from muse.rope import rotary_cos_sin


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


def initial_value(name: str, shape: torch.Size | tuple[int, ...], generator: torch.Generator,
                  std: float) -> torch.Tensor:
    """The seeded starting value of one parameter: norms at one, matrices normal(0, std)."""
    if "norm" in name:
        return torch.ones(shape)
    return torch.randn(shape, generator=generator).mul_(std)


@torch.no_grad()
def init_weights(module: nn.Module, seed: int, std: float) -> None:
    """Seeded random weights, drawn in parameter order (the same on any device)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        param.copy_(initial_value(name, param.shape, generator, std))


@torch.no_grad()
def init_weights_on_device(module: nn.Module, seed: int, std: float) -> None:
    """`init_weights`' distribution drawn by a generator on the parameters' device: fast for
    billions of parameters, but the values then depend on the device."""
    device = next(module.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in module.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TextConfig, layer_index: int,
                 attention: type[nn.Module] = Attention, moe: type[nn.Module] = LatentMoE
                 ) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = moe(config) if config.is_moe else DenseMLP(config.hidden_size,
                                                                    config.intermediate_size)

    def forward(self, x: torch.Tensor, rotary: dict[str, tuple[torch.Tensor, torch.Tensor]],
                **attention_inputs) -> torch.Tensor:
        """`attention_inputs`: what this layer's attention needs besides x, cos and sin."""
        cos, sin = rotary[self.layer_type]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, **attention_inputs)
        return x + self.mlp(self.post_attention_layernorm(x))


class MuseTextModel(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MuseForCausalLM(nn.Module):
    """Decoder + LM head. Parameter names follow the Hugging Face checkpoint layout."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.model = MuseTextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int, std: float | None = None) -> None:
        init_weights(self, seed, self.config.initializer_range if std is None else std)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        hidden_layers: Sequence[int] = (),
    ) -> CausalLMOutput:
        """Logits for every position of a [batch, length] batch.

        attention_mask: 1 for real tokens, 0 for padding (left or right).
        hidden_layers: indices of decoder layers whose outputs are returned.
        """
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, length = x.shape[:2]
        key_padding = attention_mask.bool() if attention_mask is not None else None
        if position_ids is None:
            if key_padding is None:
                position_ids = torch.arange(length, device=x.device).expand(batch, length)
            else:
                position_ids = (key_padding.long().cumsum(-1) - 1).clamp(min=0)
        rotary = {kind: rotary_cos_sin(position_ids, self.config.rope_parameters[kind],
                                       self.config.head_dim) for kind in LAYER_TYPES}
        wanted = {i % self.config.num_hidden_layers for i in hidden_layers}
        hidden_states = {}
        for index, layer in enumerate(self.model.layers):
            x = layer(x, rotary, positions=position_ids, key_padding=key_padding)
            if index in wanted:
                hidden_states[index] = x
        logits = self.lm_head(self.model.norm(x))
        return CausalLMOutput(logits=logits, hidden_states=hidden_states)

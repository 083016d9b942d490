"""The transformer layer both media encoders stack (vision and audio).

Pre-norm: x + attention(norm1(x)), then x + mlp(norm2(x)), with LayerNorms, a fused q/k/v
projection and an output projection with biases, and a GELU MLP: the parameters
`muse.info`'s encoder-layer count describes. Attention is non-causal within each packed item;
the caller passes how to attend (the varlen kernel over a packed step, or plain dense
attention for a reference run) and, for vision, 2D rotary positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from muse.rope import apply_rotary

# (q, k, v) [tokens, heads, head_dim] -> [tokens, heads, head_dim]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class EncoderAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor, attend: Attend,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        return self.proj(attend(q, k, v).flatten(1))


class EncoderMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int,
                 eps: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.attn = EncoderAttention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = EncoderMLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, attend: Attend,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attend, rotary)
        return x + self.mlp(self.norm2(x))

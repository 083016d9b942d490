"""Helpers of the layer tests: seeded tensors, a rank without processes, counted reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from muse.config import TextConfig
from muse.reference.layers import LatentMoE

# Float32 on the CPU throughout. Same computation at world size 1: exact. Sharded sums and
# gathers against one unsharded matmul: the summation order differs, so a few float32 ulps of
# values of order one.
SHARDED_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def plain_linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(randn(out_features, in_features, seed=seed))
        if bias:
            linear.bias.copy_(randn(out_features, seed=seed + 1))
    return linear


def make_latent_moe(num_experts: int, top_k: int, hidden: int, latent: int, inter: int,
                    norm: bool, seed: int) -> LatentMoE:
    """The reference latent MoE with random weights scaled so every stage is of order one."""
    config = TextConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=inter, moe_latent_size=latent, expert_norm=norm)
    moe = LatentMoE(config)
    with torch.no_grad():
        for i, param in enumerate(moe.parameters()):
            param.copy_(randn(*param.shape, seed=seed + i) / param.shape[-1] ** 0.5)
        if norm:
            moe.experts.norm_weight.add_(1.0)
    return moe


class FakeGroup:
    """A rank's place in a group (rank_in_group, world_size) without other processes, to check
    what each rank of a larger group creates and loads. Its collectives must not be reached."""

    def __init__(self, world_size: int, rank_in_group: int) -> None:
        self.world_size = world_size
        self.rank_in_group = rank_in_group

    def _collective(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a FakeGroup has no other ranks to talk to")

    all_reduce = all_gather = reduce_scatter = all_to_all = _collective


def as_tp_rank(monkeypatch: pytest.MonkeyPatch, module: str, world_size: int,
               rank: int) -> None:
    """Layers of `module` built after this see themselves as TP rank `rank` of `world_size`."""
    monkeypatch.setattr(f"{module}.get_tp_group", lambda: FakeGroup(world_size, rank))


class RecordingSlice:
    """Wraps a safetensors slice and counts the elements the loader reads through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.elements_read = 0

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.inner[index]
        self.elements_read += tensor.numel()
        return tensor


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))
    return path

"""RMSNorm's weight as a replicated engine parameter (the math is the backend's)."""

from __future__ import annotations

import torch
from torch import nn

from muse.layers.lazy_slice import LazySlice, copy_into
from muse.layers.quantization import set_weight_attrs


class RMSNorm(nn.Module):
    """Holds `weight` [size] and `eps`; every rank keeps the whole weight."""

    def __init__(self, size: int, eps: float, params_dtype: torch.dtype | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.eps = eps
        self.prefix = prefix
        self.weight = nn.Parameter(torch.empty(size, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        copy_into(param.data, LazySlice.of(loaded), f"{self.prefix}.weight")

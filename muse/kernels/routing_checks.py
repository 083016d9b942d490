"""Argument checks shared by both routing paths (the torch twin and the Triton kernel)."""

from __future__ import annotations

import torch

SCORINGS = ("softmax", "sigmoid")


def check_arguments(router_logits: torch.Tensor, top_k: int, scoring: str) -> None:
    """Raise ValueError unless the arguments suit both `route_topk` paths."""
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if router_logits.dim() != 2:
        raise ValueError("router_logits must be [tokens, experts], got "
                         f"{tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be in [1, {router_logits.shape[1]}], got {top_k}")

"""The fused routing kernel and its torch twin against the reference `route`.

The twin must be `route` exactly (same ops, bit for bit). The kernel must give the same weights
to float32 rounding and the ids of a stable descending sort of the reference scores: those of
torch.topk wherever the scores do not tie exactly (torch.topk orders ties arbitrarily).

Under Triton's interpreter every program costs milliseconds, so the kernel sweep covers every
compile-time configuration (E, k, scoring, normalize) with a few tokens, and the larger token
count on a handful of them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.config import TextConfig
from muse.kernels.routing import route_topk_torch
from muse.kernels.routing_triton import route_topk_triton
from muse.reference.layers import route
from tests.conftest import DEVICE

EXPERTS = (8, 60, 128, 256)
TOP_KS = (1, 2, 8)
SCORINGS = ("softmax", "sigmoid")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_logits(num_tokens: int, num_experts: int, dtype: torch.dtype, seed: int
                ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(num_tokens, num_experts, generator=gen)).to(DEVICE, dtype)


def reference(logits: torch.Tensor, top_k: int, scoring: str, normalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    config = TextConfig(num_experts=logits.shape[1], num_experts_per_tok=top_k,
                        router_scoring=scoring, norm_topk_prob=normalize)
    return route(logits, config)


def scores_of(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = logits.float()
    return logits.softmax(dim=-1) if scoring == "softmax" else logits.sigmoid()


def check_kernel(logits: torch.Tensor, top_k: int, scoring: str, normalize: bool) -> None:
    weights, ids = route_topk_triton(logits, top_k, scoring, normalize)
    ref_weights, ref_ids = reference(logits, top_k, scoring, normalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == (logits.shape[0], top_k)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-7)

    scores = scores_of(logits, scoring)
    # Lowest id first among equal scores.
    stable = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(ids, stable)
    # Same choice as torch.topk up to the order of exactly tied scores.
    assert torch.equal(scores.gather(1, ids), scores.gather(1, ref_ids))


@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("num_experts", EXPERTS)
def test_kernel_matches_reference(num_experts: int, top_k: int, scoring: str,
                                  normalize: bool) -> None:
    # Both dtypes, each at 1 and 5 tokens across the normalize axis.
    for i, dtype in enumerate(DTYPES.values()):
        num_tokens = 1 if (i == 0) == normalize else 5
        logits = make_logits(num_tokens, num_experts, dtype, seed=num_experts * 10 + top_k)
        check_kernel(logits, top_k, scoring, normalize)


@pytest.mark.parametrize(("num_experts", "top_k", "scoring", "normalize", "dtype"), [
    (256, 8, "sigmoid", True, "bf16"),
    (128, 2, "softmax", True, "fp32"),
    (60, 1, "softmax", False, "bf16"),
])
def test_kernel_many_tokens(num_experts: int, top_k: int, scoring: str, normalize: bool,
                            dtype: str) -> None:
    logits = make_logits(37, num_experts, DTYPES[dtype], seed=num_experts + top_k)
    check_kernel(logits, top_k, scoring, normalize)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_twin_is_reference(scoring: str, normalize: bool, dtype: torch.dtype) -> None:
    for num_experts in EXPERTS:
        for top_k in TOP_KS:
            for num_tokens in (1, 5, 37):
                logits = make_logits(num_tokens, num_experts, dtype, seed=num_tokens)
                weights, ids = route_topk_torch(logits, top_k, scoring, normalize)
                ref_weights, ref_ids = reference(logits, top_k, scoring, normalize)
                torch.testing.assert_close(weights, ref_weights, rtol=0, atol=0)
                assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_ties_take_the_lowest_id(scoring: str) -> None:
    logits = torch.tensor([
        [1.0, 3.0, 2.0, 3.0, 3.0, 0.0, 2.0, 3.0],     # four-way tie at the top
        [0.5] * 8,                                      # everything ties
        [-1.0, 2.0, -1.0, 2.0, -1.0, -1.0, -1.0, 5.0],  # ties below a clear winner
        [30.0, 0.0, 40.0, 20.0, 0.0, 50.0, 1.0, 2.0],  # sigmoid rounds 20, 30, ... to 1.0
    ], device=DEVICE)
    weights, ids = route_topk_triton(logits, 3, scoring, normalize=False)
    stable = torch.sort(scores_of(logits, scoring), dim=-1, descending=True, stable=True)
    assert torch.equal(ids, stable.indices[:, :3])
    torch.testing.assert_close(weights, stable.values[:, :3], rtol=1e-6, atol=0)
    assert ids[0].tolist() == [1, 3, 4] and ids[1].tolist() == [0, 1, 2]
    assert ids[2].tolist() == [7, 1, 3]
    if scoring == "sigmoid":
        assert ids[3].tolist() == [0, 2, 3]


def test_padding_lanes_and_strides() -> None:
    """E not a power of two with large negative logits, read through a strided view."""
    wide = make_logits(5, 2 * 60, torch.float32, seed=3) - 50.0
    logits = wide[:, ::2]  # [5, 60], column stride 2
    for scoring in SCORINGS:
        check_kernel(logits, 8, scoring, normalize=True)
        check_kernel(logits[:1], 60, scoring, normalize=False)  # k = E: all, in order


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter
@pytest.mark.parametrize("scoring", SCORINGS)
def test_a_row_of_nan_still_names_experts_that_exist(scoring: str) -> None:
    """A NaN row (a CUDA graph's padding row gone bad) must not give an id past the experts,
    which the expert kernels would index out of bounds; finite rows beside it are unchanged."""
    logits = make_logits(3, 60, torch.float32, seed=5)
    poisoned = logits.clone()
    poisoned[1] = float("nan")
    _, ids = route_topk_triton(poisoned, 8, scoring, normalize=True)
    assert int(ids.min()) >= 0 and int(ids.max()) < 60
    _, clean = route_topk_triton(logits, 8, scoring, normalize=True)
    assert torch.equal(ids[[0, 2]], clean[[0, 2]])


def test_empty_and_invalid_arguments() -> None:
    logits = torch.empty(0, 8, device=DEVICE)
    for fn in (route_topk_torch, route_topk_triton):
        weights, ids = fn(logits, 2, "softmax", True)
        assert weights.shape == ids.shape == (0, 2)
        with pytest.raises(ValueError):
            fn(logits, 2, "relu", True)
        with pytest.raises(ValueError):
            fn(logits, 9, "softmax", True)

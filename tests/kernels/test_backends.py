"""Kernel backends are chosen by name once, when a model is built, and agree with each other."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.backends import select_backends  # noqa: E402
from muse.kernels.moe import fused_experts_torch  # noqa: E402
from muse.kernels.norms import rms_norm_torch  # noqa: E402
from muse.kernels.routing import route_topk_torch  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402


def test_auto_picks_triton_on_cuda_and_the_twins_elsewhere():
    cpu = select_backends(torch.device("cpu"))
    assert (cpu.attention.name, cpu.moe.name) == ("torch", "torch")
    assert cpu.attention.rms_norm is rms_norm_torch
    assert cpu.moe.route_topk is route_topk_torch and cpu.moe.fused_experts is fused_experts_torch
    if torch.cuda.is_available():
        cuda = select_backends(torch.device("cuda"))
        assert (cuda.attention.name, cuda.moe.name) == ("triton", "triton")


def test_names_are_checked():
    with pytest.raises(ValueError, match="attention_backend"):
        select_backends(torch.device("cpu"), attention="flash")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_backends(torch.device("cpu"), moe="triton")


def test_both_backends_compute_the_same_on_the_test_device():
    """On CPU the Triton functions run under Triton's interpreter (tests/kernels/conftest)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, 64, generator=generator).to(DEVICE)
    residual = torch.randn(7, 64, generator=generator).to(DEVICE)
    weight = torch.rand(64, generator=generator).to(DEVICE)
    logits = torch.randn(7, 16, generator=generator).to(DEVICE)
    twins = select_backends(torch.device("cpu"))
    triton_backend = select_backends(torch.device("cuda")) if DEVICE == "cuda" else None
    if triton_backend is None:
        from muse.kernels.backends import ATTENTION_BACKENDS, MOE_BACKENDS, ModelBackends

        triton_backend = ModelBackends(ATTENTION_BACKENDS["triton"](), MOE_BACKENDS["triton"]())
    for backend in (twins, triton_backend):
        normed = backend.attention.rms_norm(x, weight, 1e-6)
        torch.testing.assert_close(normed, rms_norm_torch(x, weight, 1e-6))
        summed_normed, summed = backend.attention.add_rms_norm(x, residual, weight, 1e-6)
        torch.testing.assert_close(summed, x + residual)
        weights, ids = backend.moe.route_topk(logits, 2, "softmax", True)
        want_weights, want_ids = route_topk_torch(logits, 2, "softmax", True)
        torch.testing.assert_close(weights, want_weights)
        assert torch.equal(ids, want_ids)

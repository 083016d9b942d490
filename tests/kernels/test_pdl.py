"""Programmatic dependent launch (`muse.kernels.pdl`): when it is on, and that a chain of a
decode step's kernels (add + RMSNorm, GEMVs, routing, the fused experts, q/k norm + RoPE)
gives the same bits with it as without, eagerly and replayed from a CUDA graph with new
inputs. A kernel that read its input before waiting for the kernel before would read a stale
or half-written row, and the chain would differ. GPU tests need sm_90 or later; elsewhere
the kernels launch without PDL (the interpreter has no such instructions)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.pdl import pdl_enabled, pdl_options  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

HOPPER = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9


def test_off_on_the_cpu_and_when_the_environment_says_so(monkeypatch) -> None:
    assert pdl_options(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("MUSE_PDL", "0")
    assert pdl_options(torch.device("cuda")) == {"PDL": False, "launch_pdl": False}


def _layer_chain(hidden: torch.Tensor, params: dict) -> torch.Tensor:
    """Eight layers of norm -> GEMV -> q/k norm + RoPE -> GEMV -> norm -> router GEMV ->
    routing -> experts, each kernel reading the one before's output."""
    from muse.kernels.gemv_triton import dense_gemv
    from muse.kernels.moe_triton import fused_experts
    from muse.kernels.norms_triton import add_rms_norm_triton
    from muse.kernels.rotary_triton import qk_norm_rope_triton
    from muse.kernels.routing_triton import route_topk_triton

    residual = torch.zeros_like(hidden)
    for layer in params["layers"]:
        normed, residual = add_rms_norm_triton(hidden[None], residual, layer["norm"], 1e-6)
        qk = dense_gemv(normed[0], layer["qk"]).view(2, 8, 64)
        q, k = qk_norm_rope_triton(qk[:1], qk[1:], layer["q_norm"], layer["k_norm"],
                                   params["cos"], params["sin"], 1e-6)
        hidden = dense_gemv(torch.cat([q.flatten(), k.flatten()]), layer["o"])
        normed, residual = add_rms_norm_triton(hidden[None], residual, layer["norm"], 1e-6)
        logits = dense_gemv(normed[0], layer["router"])
        weights, ids = route_topk_triton(logits[None], 2, "softmax", True)
        hidden = fused_experts(normed, weights, ids, layer["gate_up"], layer["down"],
                               layer["expert_norm"], 1e-6)[0]
    return hidden + residual[0]


def _params(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, torch.bfloat16)

    layers = [dict(norm=rand(512).abs() + 0.5, qk=rand(1024, 512, scale=512 ** -0.5),
                   q_norm=rand(64).abs() + 0.5, k_norm=rand(64).abs() + 0.5,
                   o=rand(512, 1024, scale=1024 ** -0.5), router=rand(16, 512, scale=0.1),
                   gate_up=rand(16, 512, 512, scale=512 ** -0.5),
                   down=rand(16, 512, 256, scale=256 ** -0.5), expert_norm=rand(16, 512))
              for _ in range(8)]
    angles = torch.rand(1, 32, generator=gen).to(DEVICE) * 6.28
    return dict(layers=layers, cos=torch.cat([angles.cos()] * 2, dim=1),
                sin=torch.cat([angles.sin()] * 2, dim=1))


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs sm_90 or later")
def test_a_layer_chain_gives_the_same_bits_with_and_without_pdl(monkeypatch) -> None:
    from tests.kernels.graph_capture import capture

    params = _params(seed=3)
    start = torch.randn(512, device=DEVICE).to(torch.bfloat16)
    hidden = torch.empty_like(start)
    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MUSE_PDL", flag)
        hidden.copy_(start)
        assert pdl_enabled(hidden.device) == (flag == "1")
        eager = _layer_chain(hidden, params)
        graph, out = capture(lambda: _layer_chain(hidden, params))
        replays = []
        for step in range(4):
            hidden.copy_(torch.randn(512, generator=torch.Generator().manual_seed(step)))
            graph.replay()
            replays.append(out.clone())
        results[flag] = (eager, replays)
    (eager_off, replays_off), (eager_on, replays_on) = results["0"], results["1"]
    assert torch.isfinite(eager_off).all()
    assert torch.equal(eager_off, eager_on)
    for off, on in zip(replays_off, replays_on):
        assert torch.equal(off, on)
    # The inputs changed between replays, and so did the outputs: the graph really ran.
    assert not torch.equal(replays_on[0], replays_on[1])


_COMPILE_FOR_HOPPER = r"""
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import gemv_triton, norms_triton, paged_attention_triton

compile_for_hopper(norms_triton._rms_norm_kernel,
                   dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16",
                        sum_ptr="*bf16"),
                   dict(HAS_RESIDUAL=True, BLOCK=2048, PDL=True), set(), num_warps=8)
compile_for_hopper(gemv_triton._dense_gemv_kernel,
                   dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", y_ptr="*bf16",
                        partial_ptr="*fp32", counter_ptr="*i32"),
                   dict(K=4096, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=2048, K_PER_PROGRAM=2048,
                        SPLIT=2, PDL=True), {"stride_xk", "stride_yn"}, num_stages=1)
compile_for_hopper(paged_attention_triton._decode_kernel,
                   dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16",
                        ws_acc_ptr="*fp32", ws_m_ptr="*fp32", ws_l_ptr="*fp32",
                        tables_ptr="*i64", first_block_ptr="*i64", seq_lens_ptr="*i64",
                        query_start_ptr="*i64", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                        scale_log2="fp32"),
                   dict(GROUP=2, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64,
                        BLOCK_SIZE=16, NUM_SPLITS=33, SLIDING=False, PRECISION="tf32",
                        FP8=False, PDL=True), set(), num_stages=2)
print("compiled")
"""


def test_kernels_launched_with_pdl_compile_for_hopper() -> None:
    """The norm, the GEMV and decode attention compile for sm_90 with the PDL instructions in."""
    from tests.kernels.hopper_compile import assert_script_compiles

    assert_script_compiles(_COMPILE_FOR_HOPPER)

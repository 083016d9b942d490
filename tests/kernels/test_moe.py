"""The fused latent experts: Triton path vs torch twin vs the reference `LatentMoE`.

The reference is the whole layer (pooler, router, per-expert loop, unpooler); the fused paths
replace only its expert loop, so they are checked by plugging them between its pooler and
unpooler. Routing comes from `route`, as in the model: top-k ids never repeat within a token.

The Triton path has two modes, picked from the numbers of pairs and experts: aligned (pairs
sorted by expert into blocks) and one pair per block (decode sizes, no alignment). The layer tests run whichever
the threshold picks; `test_decode_modes` forces each on the same small batches.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

from muse.config import TextConfig
from muse.kernels import moe_triton
from muse.kernels.moe import fused_experts_torch, fused_experts_triton
from muse.kernels.moe_align import align_pairs, max_padded_pairs
from muse.kernels.moe_triton import (
    ONE_PAIR_PER_BLOCK_MAX_PAIRS,
    choose_tiles,
    use_one_pair_per_block,
)
from muse.reference.layers import LatentMoE, route
from tests.conftest import DEVICE
from tests.kernels.graph_capture import capture

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
HIDDEN = 24



@pytest.fixture(autouse=True)
def experts_never_l2_resident(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests' experts are tiny, so every call of up to 64 pairs would skip the alignment
    (`use_one_pair_per_block`); here only the pairs-per-expert rule decides, so that small
    shapes exercise the aligned path too. The L2 rule has its own test."""
    monkeypatch.setattr(moe_triton, "L2_RESIDENT_EXPERT_BYTES", 0)

def make_moe(num_experts: int, top_k: int, latent: int, inter: int, norm: bool,
             dtype: torch.dtype, seed: int = 0) -> LatentMoE:
    config = TextConfig(hidden_size=HIDDEN, num_experts=num_experts, num_experts_per_tok=top_k,
                        moe_intermediate_size=inter, moe_latent_size=latent, expert_norm=norm)
    moe = LatentMoE(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Scaled so every stage's output is of order one.
        for param in moe.parameters():
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen) / fan_in ** 0.5)
        if norm:
            moe.experts.norm_weight.copy_(1 + 0.2 * torch.randn(num_experts, latent, generator=gen))
    return moe.to(DEVICE, dtype)


def make_tokens(moe: LatentMoE, num_tokens: int, chosen: list[int] | None, seed: int = 1
                ) -> torch.Tensor:
    """Random tokens; with `chosen`, the router is rigged so that only those experts win."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    if chosen is not None:
        # Feature 0 is a constant that only the chosen experts' router rows read, strongly.
        x[:, 0] = 4.0
        with torch.no_grad():
            moe.gate.weight[:, 0] = 0.0
            moe.gate.weight[chosen, 0] = 3.0
    return x.to(DEVICE, moe.gate.weight.dtype)


def run_fused(fn, moe: LatentMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output with `fn` in place of its expert loop, and the routed ids."""
    weights, ids = route(moe.gate(x), moe.config)
    experts = moe.experts
    combined = fn(moe.pooler(x), weights, ids, experts.gate_up_proj, experts.down_proj,
                  experts.norm_weight, experts.eps)
    return moe.unpooler(combined), ids


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    scale = expected.float().abs().max().item()
    assert scale > 0.1
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


def check_layer(moe: LatentMoE, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    with torch.no_grad():
        expected = moe(x)
        twin, ids = run_fused(fused_experts_torch, moe, x)
        triton_out, _ = run_fused(fused_experts_triton, moe, x)
    assert triton_out.dtype == twin.dtype == expected.dtype == dtype
    assert_close(twin, expected, dtype)
    assert_close(triton_out, expected, dtype)
    assert_close(triton_out, twin, dtype)
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [
    (1, 8, 1), (1, 8, 4), (3, 4, 2), (3, 8, 4), (37, 4, 1), (37, 8, 2), (37, 8, 4)])
def test_matches_reference_layer(num_tokens: int, num_experts: int, top_k: int, norm: bool,
                                 dtype: torch.dtype) -> None:
    # One pair per block at 1 and 4 pairs over 8 experts, the aligned path everywhere else.
    one_pair = (num_tokens, num_experts, top_k) in ((1, 8, 1), (1, 8, 4))
    assert use_one_pair_per_block(num_tokens * top_k, num_experts) == one_pair
    moe = make_moe(num_experts, top_k, latent=32, inter=48, norm=norm, dtype=dtype)
    x = make_tokens(moe, num_tokens, chosen=None)
    ids = check_layer(moe, x, dtype)
    if num_tokens * top_k < num_experts:
        assert ids.unique().numel() < num_experts  # some experts got no token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("top_k", "chosen"), [
    (1, [5]),           # every token on one expert
    (2, [1, 6]),        # every token on the same two experts
    (2, [0, 3, 7]),     # three experts share all pairs, five get none
])
def test_concentrated_routing(top_k: int, chosen: list[int], dtype: torch.dtype) -> None:
    moe = make_moe(8, top_k, latent=32, inter=32, norm=True, dtype=dtype, seed=2)
    x = make_tokens(moe, 37, chosen=chosen)
    ids = check_layer(moe, x, dtype)
    assert set(ids.unique().tolist()) == set(chosen)


@pytest.mark.parametrize(("dtype", "norm"), [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-norm", "bf16-no_norm"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "chosen"), [
    (1, 8, 8, None),      # every expert once
    (2, 8, 4, [1, 6]),    # both tokens on experts 1 and 6, next to two others each
    (3, 16, 8, None),     # 24 pairs over 16 experts: experts repeat across tokens
    (3, 8, 2, [0, 5]),    # every token on the same two experts
])
def test_decode_modes(num_tokens: int, num_experts: int, top_k: int, chosen: list[int] | None,
                      norm: bool, dtype: torch.dtype) -> None:
    """Both modes, forced, against the twin on decode-sized batches with repeated experts."""
    moe = make_moe(num_experts, top_k, latent=32, inter=32, norm=norm, dtype=dtype, seed=5)
    x = make_tokens(moe, num_tokens, chosen=chosen, seed=num_tokens)
    with torch.no_grad():
        twin, ids = run_fused(fused_experts_torch, moe, x)
        for mode in (True, False):
            def fn(*args, mode=mode):
                return fused_experts_triton(*args, one_pair_per_block=mode)
            out, _ = run_fused(fn, moe, x)
            assert out.dtype == dtype
            assert_close(out, twin, dtype)
    flat = ids.reshape(-1)
    assert flat.unique().numel() < flat.numel() or num_tokens == 1  # shared experts
    if chosen is not None:
        assert set(chosen) <= set(flat.tolist())


class _OpLog(TorchDispatchMode):
    """Records the name of every aten op that runs while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool | None]]:
    """Replace the three kernels by recorders of (kernel, ONE_PAIR_PER_BLOCK)."""
    launches: list[tuple[str, bool | None]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs) -> None:
                launches.append((self.name, kwargs.get("ONE_PAIR_PER_BLOCK")))
            return launch

    for name in ("_gemm1_swiglu_kernel", "_gemm2_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe_triton, name, Recorder(name))
    return launches


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "one_pair"), [
    (1, 128, 8, True),
    (8, 128, 8, True),     # 64 pairs: the largest decode batch of Qwen3-30B-A3B's shape
    (13, 128, 5, False),   # 65 pairs
    (3, 16, 4, True),      # 12 pairs over 16 experts
    (3, 8, 4, False),      # more pairs than experts
])
def test_threshold_and_decode_launches(monkeypatch: pytest.MonkeyPatch, num_tokens: int,
                                       num_experts: int, top_k: int, one_pair: bool) -> None:
    """One pair per block: three launches and output allocations, no other torch op at all;
    aligned: the alignment's torch ops before the same three launches."""
    assert ONE_PAIR_PER_BLOCK_MAX_PAIRS == 64
    assert use_one_pair_per_block(num_tokens * top_k, num_experts) == one_pair
    launches = _record_launches(monkeypatch)
    latent, inter = 32, 48
    x = torch.randn(num_tokens, latent, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = torch.randn(num_tokens, num_experts, device=DEVICE).softmax(-1).topk(top_k)
    gate_up = torch.randn(num_experts, 2 * inter, latent, device=DEVICE, dtype=torch.bfloat16)
    down = torch.randn(num_experts, latent, inter, device=DEVICE, dtype=torch.bfloat16)
    norm = torch.ones(num_experts, latent, device=DEVICE, dtype=torch.bfloat16)
    with _OpLog() as log:
        moe_triton.fused_experts(x, weights, ids, gate_up, down, norm, 1e-6)
    kernels = ["_gemm1_swiglu_kernel", "_gemm2_kernel", "_moe_combine_kernel"]
    assert [name for name, _ in launches] == kernels
    assert [flag for _, flag in launches[:2]] == [one_pair, one_pair]
    allocations = {"aten.empty.memory_format"}
    if one_pair:
        assert set(log.ops) == allocations and len(log.ops) == 3  # out, h, y
    else:
        assert len(set(log.ops) - allocations) > 5  # align_pairs' ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_widths_off_the_tiles(dtype: torch.dtype) -> None:
    """Latent and intermediate widths that no tile divides exercise every mask."""
    moe = make_moe(4, 2, latent=40, inter=24, norm=True, dtype=dtype, seed=3)
    check_layer(moe, make_tokens(moe, 5, chosen=None), dtype)


def test_prefill_tiles() -> None:
    """Enough pairs per expert for the largest blocks (128 rows)."""
    assert choose_tiles(100 * 4, 4).block_m == 128
    moe = make_moe(4, 4, latent=32, inter=32, norm=True, dtype=torch.float32, seed=4)
    check_layer(moe, make_tokens(moe, 100, chosen=None), torch.float32)


def test_no_tokens() -> None:
    moe = make_moe(4, 2, latent=32, inter=32, norm=True, dtype=torch.float32)
    x = torch.empty(0, HIDDEN, device=DEVICE)
    with torch.no_grad():
        for fn in (fused_experts_torch, fused_experts_triton):
            out, _ = run_fused(fn, moe, x)
            assert out.shape == (0, HIDDEN)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "block_m"), [
    (1, 8, 4, 16), (3, 4, 2, 16), (37, 8, 2, 16), (37, 8, 4, 64), (5, 64, 2, 16)])
def test_align_pairs(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    ids = logits.topk(top_k, dim=-1).indices.to(DEVICE)
    num_pairs = ids.numel()
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    assert sorted_pairs.numel() == max_padded_pairs(num_pairs, num_experts, block_m)
    assert block_expert.numel() * block_m == sorted_pairs.numel()

    flat, blocks = ids.reshape(-1).cpu(), sorted_pairs.view(-1, block_m).cpu()
    real = sorted_pairs[sorted_pairs < num_pairs].cpu()
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair exactly once
    used = block_expert >= 0
    assert used.cpu().tolist() == sorted(used.cpu().tolist(), reverse=True)  # used blocks first
    for block, expert in zip(blocks, block_expert.cpu().tolist()):
        pairs = block[block < num_pairs]
        if expert < 0:
            assert pairs.numel() == 0
        else:
            assert pairs.numel() > 0 and (flat[pairs] == expert).all()
            assert block[:pairs.numel()].tolist() == pairs.tolist()  # padding at the end
    assert block_expert[used].cpu().tolist() == sorted(block_expert[used].cpu().tolist())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_with_new_routing() -> None:
    moe = make_moe(8, 2, latent=32, inter=48, norm=True, dtype=torch.bfloat16)
    experts = moe.experts
    x = make_tokens(moe, 4, chosen=None)
    static = {"x": moe.pooler(x).detach().clone()}
    static["weights"], static["ids"] = route(moe.gate(x), moe.config)

    def step() -> torch.Tensor:
        return fused_experts_triton(static["x"], static["weights"], static["ids"],
                                    experts.gate_up_proj, experts.down_proj,
                                    experts.norm_weight, experts.eps)

    with torch.no_grad():
        graph, out = capture(step)
        for seed, chosen in ((7, None), (8, [2]), (9, [0, 5])):
            x = make_tokens(moe, 4, chosen=chosen, seed=seed)
            weights, ids = route(moe.gate(x), moe.config)
            static["x"].copy_(moe.pooler(x))
            static["weights"].copy_(weights)
            static["ids"].copy_(ids)
            graph.replay()
            expected = fused_experts_torch(static["x"], weights, ids, experts.gate_up_proj,
                                           experts.down_proj, experts.norm_weight, experts.eps)
            assert_close(out, expected, torch.bfloat16)


def test_small_experts_skip_the_alignment_past_one_pair_per_expert(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """More pairs than experts align, unless every expert fits in L2 together (then the
    repeated reads are cheap), and never past 64 pairs; `fused_experts` counts the experts'
    bytes as stored."""
    monkeypatch.setattr(moe_triton, "L2_RESIDENT_EXPERT_BYTES", 16 * 2**20)
    small, large = 4 * 2**20, 1 << 30
    assert not use_one_pair_per_block(16, 8)
    assert use_one_pair_per_block(16, 8, small)
    assert use_one_pair_per_block(64, 8, small)
    assert not use_one_pair_per_block(65, 8, small)
    assert not use_one_pair_per_block(16, 8, large)
    assert use_one_pair_per_block(8, 8, large)
    launches = _record_launches(monkeypatch)
    num_tokens, num_experts, top_k, latent, inter = 4, 8, 4, 32, 48  # 16 pairs, tiny experts
    x = torch.randn(num_tokens, latent, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = torch.randn(num_tokens, num_experts, device=DEVICE).softmax(-1).topk(top_k)
    gate_up = torch.randn(num_experts, 2 * inter, latent, device=DEVICE, dtype=torch.bfloat16)
    down = torch.randn(num_experts, latent, inter, device=DEVICE, dtype=torch.bfloat16)
    moe_triton.fused_experts(x, weights, ids, gate_up, down, None, 1e-6)
    assert [flag for _, flag in launches[:2]] == [True, True]  # (numerics: forced-mode tests)


def test_combine_compiles_for_hopper() -> None:
    """The tiled combine at the 15B shape's top-8 of 1024 and the full model's of 4096."""
    from tests.kernels.hopper_compile import assert_script_compiles
    assert_script_compiles(r"""
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels import moe_triton as m
pointers = dict(y_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", norm_ptr="*bf16",
                out_ptr="*bf16", eps="fp32")
for block_l, warps in ((1024, 8), (4096, 16)):
    compile_for_hopper(m._moe_combine_kernel, pointers,
                       dict(TOP_K=8, BLOCK_K=8, BLOCK_L=block_l, HAS_NORM=True, PDL=True),
                       set(), num_warps=warps)
print("compiled")
""")

"""The routed experts in one persistent launch (`muse.kernels.moe_persistent_triton`) against
the torch twin and the three-launch decode path. Small sizes, widths off the tiles; on the
CPU under Triton's interpreter, whose programs run one after another (the first takes every
work item, so each wait finds what it waits for already done)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels import moe_persistent_triton as persistent  # noqa: E402
from muse.kernels.moe import fused_experts_torch, fused_experts_triton  # noqa: E402
from tests.kernels.test_moe import (assert_close, assert_graph_follows_routing,  # noqa: E402
                                    make_moe, make_tokens, run_fused)


def _run(moe, x):
    return run_fused(lambda *args: persistent.persistent_experts(*args), moe, x)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "latent", "inter"), [
    (1, 8, 4, 48, 40), (3, 5, 2, 32, 136), (2, 4, 4, 160, 24)])
def test_one_launch_matches_the_twin_and_the_three_launches(
        num_tokens: int, num_experts: int, top_k: int, latent: int, inter: int, norm: bool,
        dtype: torch.dtype) -> None:
    """Widths off the tiles (I over several 16-column tiles and past one 128-wide K step, L
    past one 32-column tile), experts shared between tokens; and the counters are back to
    zero after every launch, so a second launch gives the same bits."""
    moe = make_moe(num_experts, top_k, latent=latent, inter=inter, norm=norm, dtype=dtype,
                   seed=7)
    x = make_tokens(moe, num_tokens, chosen=None, seed=num_tokens)
    with torch.no_grad():
        twin, _ = run_fused(fused_experts_torch, moe, x)
        three, _ = run_fused(lambda *a: fused_experts_triton(*a, one_pair_per_block=True),
                             moe, x)
        one = _run(moe, x)
        assert one.dtype == dtype
        assert_close(one, twin, dtype)
        assert_close(one, three, dtype)
        assert not persistent._counters(x.device).any()
        assert torch.equal(_run(moe, x), one)


def test_each_routed_expert_counts() -> None:
    """A negative control: changing one routed expert's down projection changes the output
    of the tokens routed to it and of no other."""
    moe = make_moe(6, 2, latent=32, inter=40, norm=True, dtype=torch.float32, seed=3)
    x = make_tokens(moe, 3, chosen=None, seed=4)
    with torch.no_grad():
        before = _run(moe, x)
        ids = run_fused(fused_experts_torch, moe, x)[1]
        expert = int(ids[0, 0])
        moe.experts.down_proj[expert] *= -1
        after = _run(moe, x)
    routed = (ids == expert).any(dim=1)
    changed = (after - before).abs().amax(dim=1) > 1e-6
    assert torch.equal(changed, routed)


def test_fused_experts_takes_it_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fused_experts` runs the persistent launch for decode-sized calls when switched on, not
    for many pairs (the aligned path) nor when off."""
    calls = []
    original = persistent.persistent_experts

    def counted(*args):
        calls.append(args[0].shape[0])
        return original(*args)

    monkeypatch.setattr("muse.kernels.moe_triton.persistent_experts", counted)
    moe = make_moe(8, 2, latent=32, inter=32, norm=True, dtype=torch.bfloat16, seed=1)
    with torch.no_grad():
        run_fused(fused_experts_triton, moe, make_tokens(moe, 2, chosen=None))
        assert calls == []
        monkeypatch.setattr(persistent, "PERSISTENT_MOE_ON", True)
        run_fused(fused_experts_triton, moe, make_tokens(moe, 2, chosen=None))
        assert calls == [2]
        run_fused(fused_experts_triton, moe, make_tokens(moe, 40, chosen=None))
        assert calls == [2]  # 80 pairs over 8 experts: aligned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_with_new_routing_on_many_programs() -> None:
    """Compiled, one program per SM, every wait real: a captured launch replayed with new
    routing each time (the counters it leaves at zero are the next replay's start)."""
    moe = make_moe(8, 4, latent=64, inter=96, norm=True, dtype=torch.bfloat16)
    assert_graph_follows_routing(persistent.persistent_experts, moe, num_tokens=3,
                                 seeds=(7, 8, 9, 10))
    assert not persistent._counters(moe.gate.weight.device).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled, many programs")
def test_many_items_per_program_match_the_three_launches() -> None:
    """Far more work items than programs (about 3,600 over two programs an SM), so each
    program runs GEMM 1 tiles, then GEMM 2 tiles that wait for other programs' GEMM 1."""
    moe = make_moe(16, 8, latent=2048, inter=768, norm=True, dtype=torch.bfloat16, seed=5)
    x = make_tokens(moe, 4, chosen=None, seed=6)
    with torch.no_grad():
        three, _ = run_fused(lambda *a: fused_experts_triton(*a, one_pair_per_block=True),
                             moe, x)
        assert_close(_run(moe, x), three, torch.bfloat16)
    assert not persistent._counters(x.device).any()

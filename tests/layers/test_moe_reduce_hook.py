"""The `reduce_pairs` hook of the fused experts (what FusedMoE's TP all-reduce plugs into), on
the Triton path (Triton's interpreter on CPU machines) and its torch twin: absent or the
identity it changes nothing; any hook acts on the per-pair float32 outputs before the expert
norms, the same on both paths; and summing two intermediate halves' pairs there reproduces the
unsharded experts, which summing their combined outputs does not."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.moe import fused_experts_torch, fused_experts_triton
from tests.conftest import DEVICE
from tests.kernels.graph_capture import capture
from tests.layers.common import randn

# As tests/kernels/test_moe.py: the kernels' float32 dots are IEEE, the order differs.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
NUM_EXPERTS, TOP_K, LATENT, INTER, EPS = 8, 2, 32, 32, 1e-6
MODES = [True, False]  # one pair per block (decode) and the aligned path
MODE_IDS = ["one_pair_per_block", "aligned"]


def make_inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    scores = randn(num_tokens, NUM_EXPERTS, seed=seed + 1).softmax(-1)
    weights, ids = scores.topk(TOP_K, dim=-1)
    tensors = {
        "x": randn(num_tokens, LATENT, seed=seed),
        "weights": weights,
        "expert_ids": ids,
        "gate_up": randn(NUM_EXPERTS, 2 * INTER, LATENT, seed=seed + 2) / LATENT ** 0.5,
        "down": randn(NUM_EXPERTS, LATENT, INTER, seed=seed + 3) / INTER ** 0.5,
        "norm_weight": 1 + 0.2 * randn(NUM_EXPERTS, LATENT, seed=seed + 4),
    }
    return {name: tensor.to(DEVICE, dtype if tensor.is_floating_point() and name != "weights"
                            else tensor.dtype) for name, tensor in tensors.items()}


def run(fn, inputs: dict[str, torch.Tensor], **kwargs) -> torch.Tensor:
    return fn(inputs["x"], inputs["weights"], inputs["expert_ids"], inputs["gate_up"],
              inputs["down"], inputs["norm_weight"], EPS, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    scale = expected.float().abs().max().item()
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("one_pair_per_block", MODES, ids=MODE_IDS)
def test_identity_hook_changes_nothing(one_pair_per_block: bool) -> None:
    inputs = make_inputs(3, torch.float32)
    seen = []

    def identity(y: torch.Tensor) -> torch.Tensor:
        seen.append((tuple(y.shape), y.dtype))
        return y

    without = run(fused_experts_triton, inputs, one_pair_per_block=one_pair_per_block)
    with_hook = run(fused_experts_triton, inputs, one_pair_per_block=one_pair_per_block,
                    reduce_pairs=identity)
    assert seen == [((3 * TOP_K, LATENT), torch.float32)]  # once, per pair, float32
    torch.testing.assert_close(with_hook, without, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("one_pair_per_block", MODES, ids=MODE_IDS)
def test_hook_matches_the_twin(one_pair_per_block: bool, dtype: torch.dtype) -> None:
    """A hook that is not scale-invariant (the norm would hide a scaling): adding a fixed
    tensor to every pair's output."""
    inputs = make_inputs(3, dtype, seed=10)
    offset = randn(3 * TOP_K, LATENT, seed=11).to(DEVICE)

    def add_offset(y: torch.Tensor) -> torch.Tensor:
        return y + offset

    triton_out = run(fused_experts_triton, inputs, one_pair_per_block=one_pair_per_block,
                     reduce_pairs=add_offset)
    twin = run(fused_experts_torch, inputs, reduce_pairs=add_offset)
    assert_close(triton_out, twin, dtype)
    without = run(fused_experts_torch, inputs)
    assert not torch.allclose(twin.float(), without.float(), rtol=0.1, atol=0.1)


def half(inputs: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """The inputs of TP rank `index` of 2: half of every expert's intermediate width."""
    h = INTER // 2
    mine = slice(index * h, (index + 1) * h)
    gate, up = inputs["gate_up"][:, :INTER], inputs["gate_up"][:, INTER:]
    return inputs | {"gate_up": torch.cat([gate[:, mine], up[:, mine]], dim=1).contiguous(),
                     "down": inputs["down"][:, :, mine].contiguous()}


@pytest.mark.parametrize("one_pair_per_block", MODES, ids=MODE_IDS)
def test_summing_pairs_before_the_norm_is_tensor_parallelism(one_pair_per_block: bool) -> None:
    inputs = make_inputs(5, torch.float32, seed=20)
    expected = run(fused_experts_torch, inputs)
    # "Rank 1"'s partial pair outputs, captured by a hook on its own run.
    captured = []
    rank1_combined = run(fused_experts_torch, half(inputs, 1),
                         reduce_pairs=lambda y: captured.append(y.clone()) or y)

    def all_reduce(y: torch.Tensor) -> torch.Tensor:
        return y.add_(captured[0])  # in place, as an NCCL all-reduce would

    got = run(fused_experts_triton, half(inputs, 0), one_pair_per_block=one_pair_per_block,
              reduce_pairs=all_reduce)
    assert_close(got, expected, torch.float32)
    # Reducing after the combine instead normalises each half on its own: wrong.
    rank0_combined = run(fused_experts_triton, half(inputs, 0),
                         one_pair_per_block=one_pair_per_block)
    assert not torch.allclose(rank0_combined + rank1_combined, expected, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_the_hook_with_new_routing() -> None:
    """A captured decode step with an in-place hook (as an NCCL all-reduce is) replays it."""
    inputs = make_inputs(4, torch.bfloat16, seed=30)
    offset = randn(4 * TOP_K, LATENT, seed=31).to(DEVICE)

    def add_offset(y: torch.Tensor) -> torch.Tensor:
        return y.add_(offset)

    static = dict(inputs)
    for name in ("x", "weights", "expert_ids"):
        static[name] = inputs[name].clone()

    def step() -> torch.Tensor:
        return run(fused_experts_triton, static, reduce_pairs=add_offset)

    graph, out = capture(step)
    for seed in (40, 41, 42):
        fresh = make_inputs(4, torch.bfloat16, seed=seed)
        for name in ("x", "weights", "expert_ids"):
            static[name].copy_(fresh[name])
        graph.replay()
        expected = run(fused_experts_torch, static, reduce_pairs=lambda y: y + offset)
        assert_close(out, expected, torch.bfloat16)

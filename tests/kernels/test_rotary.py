"""q/k per-head RMSNorm + rotary: Triton kernel, torch twin and the reference `qkv` agree."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.config import RopeParameters, TextConfig  # noqa: E402
from muse.kernels.rotary import qk_norm_rope, qk_norm_rope_torch  # noqa: E402
from muse.kernels.rotary_triton import qk_norm_rope_triton  # noqa: E402
from muse.reference.layers import AttentionProjections, rms_norm  # noqa: E402
from muse.rope import apply_rotary, rotary_cos_sin  # noqa: E402
from tests.conftest import DEVICE  # noqa: E402

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# See tests/kernels/test_norms.py: reduction order, and the interpreter's bfloat16 rounding,
# which the rotation can cancel down to a value smaller than the ulp it inherited.
ULPS = {torch.float32: 16, torch.bfloat16: 4}


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    scale = expected.float().abs().max().clamp(min=1.0)
    atol = ULPS[expected.dtype] * torch.finfo(expected.dtype).eps * float(scale)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=0.0, atol=atol)


def make(tokens, q_heads, k_heads, dim, dtype, norm, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tokens, q_heads, dim, generator=gen) * 3).to(dtype).to(DEVICE)
    k = (torch.randn(tokens, k_heads, dim, generator=gen) * 3).to(dtype).to(DEVICE)
    q_weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(DEVICE) if norm else None
    k_weight = (1 + 0.3 * torch.randn(dim, generator=gen)).to(DEVICE) if norm else None
    positions = torch.randint(0, 5000, (tokens,), generator=gen).to(DEVICE)
    # YaRN, so cos/sin carry an attention scale != 1 as the kernel must allow.
    rope = RopeParameters(rope_type="yarn", factor=4.0, original_max_position_embeddings=1024)
    cos, sin = rotary_cos_sin(positions, rope, dim)
    return q, k, q_weight, k_weight, cos, sin


def reference(q, k, q_weight, k_weight, cos, sin):
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, EPS), rms_norm(k, k_weight, EPS)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


# (tokens, q heads, k heads, head_dim). The interpreter runs one program at a time, so the
# 37-token cases keep few heads and the many-head cases few tokens. Past 64 tokens a program
# takes up to 8 heads: 20 heads span three groups, the last one partly masked.
CASES = [
    (1, 1, 1, 16), (1, 8, 2, 128), (3, 5, 3, 64), (37, 2, 1, 64), (37, 1, 1, 128),
    (37, 2, 1, 16), (65, 20, 4, 16),
]


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}_q{}_k{}_d{}".format(*c))
def test_twin_is_the_reference_and_triton_matches(case, dtype, norm):
    args = make(*case, dtype, norm)
    want = reference(*args)
    twin = qk_norm_rope_torch(*args, EPS)
    for got, expected in zip(twin, want):
        assert torch.equal(got, expected)
    for got, expected in zip(qk_norm_rope_triton(*args, EPS), want):
        assert_close_ulps(got, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_attention_projections_qkv(dtype):
    config = TextConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                        hidden_size=96)
    tokens = 9
    torch.manual_seed(0)
    layer = AttentionProjections(config, 0)
    with torch.no_grad():
        layer.q_norm.weight.normal_(1.0, 0.3)
        layer.k_norm.weight.normal_(1.0, 0.3)
    layer = layer.to(DEVICE, dtype)
    x = torch.randn(tokens, config.hidden_size, device=DEVICE).to(dtype)
    cos, sin = rotary_cos_sin(torch.arange(tokens, device=DEVICE), RopeParameters(), 64)
    with torch.no_grad():
        want_q, want_k, _ = layer.qkv(x, cos, sin)
        q = layer.q_proj(x).view(tokens, 4, 64)
        k = layer.k_proj(x).view(tokens, 2, 64)
    weights = (layer.q_norm.weight.detach(), layer.k_norm.weight.detach())
    got = qk_norm_rope_torch(q, k, *weights, cos, sin, config.rms_norm_eps)
    assert torch.equal(got[0], want_q) and torch.equal(got[1], want_k)
    got = qk_norm_rope_triton(q, k, *weights, cos, sin, config.rms_norm_eps)
    assert_close_ulps(got[0], want_q)
    assert_close_ulps(got[1], want_k)


def test_triton_reads_q_and_k_out_of_a_fused_projection():
    """q and k as strided views of one [T, (Hq + 2 Hk) * D] buffer, as a fused qkv GEMM gives."""
    tokens, q_heads, k_heads, dim = 5, 4, 2, 32
    q, k, q_weight, k_weight, cos, sin = make(tokens, q_heads, k_heads, dim, torch.float32, True)
    fused = torch.cat([q.flatten(1), k.flatten(1), torch.zeros_like(k.flatten(1))], dim=1)
    q_view = fused[:, :q_heads * dim].view(tokens, q_heads, dim)
    k_view = fused[:, q_heads * dim:(q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    assert not q_view.is_contiguous() and not k_view.is_contiguous()
    got = qk_norm_rope_triton(q_view, k_view, q_weight, k_weight, cos, sin, EPS)
    for got_part, want_part in zip(got, reference(q, k, q_weight, k_weight, cos, sin)):
        assert got_part.is_contiguous()
        assert_close_ulps(got_part, want_part)


def test_the_fused_path_on_the_test_device():
    args = make(5, 8, 2, 64, torch.bfloat16, True, seed=1)
    for got, want in zip(qk_norm_rope(*args, EPS), reference(*args)):
        assert_close_ulps(got, want)


def test_one_sided_norm_and_mixed_weight_dtypes():
    q, k, q_weight, k_weight, cos, sin = make(3, 2, 1, 32, torch.bfloat16, True, seed=2)
    # A norm on q only: the kernel refuses it, the dispatcher hands it to the twin.
    with pytest.raises(ValueError):
        qk_norm_rope_triton(q, k, q_weight, None, cos, sin, EPS)
    got = qk_norm_rope(q, k, q_weight, None, cos, sin, EPS)
    want = (apply_rotary(rms_norm(q, q_weight, EPS), cos, sin), apply_rotary(k, cos, sin))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Weights of different dtypes are fine (as in a half-converted checkpoint).
    for weights in ((q_weight, k_weight.bfloat16()), (q_weight.bfloat16(), k_weight)):
        got = qk_norm_rope_triton(q, k, *weights, cos, sin, EPS)
        for got_part, want_part in zip(got, reference(q, k, *weights, cos, sin)):
            assert_close_ulps(got_part, want_part)

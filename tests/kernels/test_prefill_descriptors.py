"""Prefill reading a request's keys from this step's K/V rows through tensor descriptors
(on by default on sm_90+, `MUSE_PREFILL_TMA=0` turns it off) against reading them from the
cache pages, and the rows it accepts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from muse.kernels.paged_attention_triton import _has_tma, _prefill, _reads_by_descriptor
from tests.kernels.hopper_compile import assert_script_compiles
from tests.kernels.test_paged_attention_triton import check, make_batch

# Fresh prompts (no cached context: read by descriptor) beside chunks after cached context
# (read from the pages), one longer than a 128-key tile.
FRESH_AND_CACHED = [(0, 37), (33, 20), (0, 9), (70, 24), (0, 150)]


def _step_rows(k_cache, v_cache, kind, num_heads):
    """This step's K and V as the model holds them: K a tensor of its own, V a view into the
    fused q/k/v projection's output (rows strided by the whole projection)."""
    kv_heads, head_dim = k_cache.shape[2:]
    slots = kind.slot_mapping
    k = k_cache.view(-1, kv_heads, head_dim)[slots].contiguous()
    fused = torch.zeros(slots.shape[0], (num_heads + 2 * kv_heads) * head_dim,
                        dtype=k.dtype, device=k.device)
    v = fused[:, (num_heads + kv_heads) * head_dim:].view(-1, kv_heads, head_dim)
    v.copy_(v_cache.view(-1, kv_heads, head_dim)[slots])
    return k, v


@pytest.mark.parametrize(("window", "group", "dtype"), [
    (None, 2, torch.bfloat16), (16, 4, torch.bfloat16), (40, 1, torch.float16),
    (None, 8, torch.float16)])
def test_descriptor_reads_give_the_page_reads_bits(device, window, group, dtype):
    q, k_cache, v_cache, meta, kind = make_batch(
        FRESH_AND_CACHED, block_size=16, window=window, kv_heads=2, group=group, head_dim=32,
        dtype=dtype, device=device)
    new_kv = _step_rows(k_cache, v_cache, kind, q.shape[1])
    scale = 32 ** -0.5
    pages = _prefill(q, k_cache, v_cache, meta, kind, window, scale, fresh=False)
    rows = _prefill(q, k_cache, v_cache, meta, kind, window, scale, new_kv=new_kv, fresh=True)
    torch.testing.assert_close(rows, pages, atol=0, rtol=0)
    # And the twin, as every kernel path must.
    check(FRESH_AND_CACHED, device=device, window=window, group=group, dtype=dtype,
          run=lambda *args: _prefill(*args, new_kv=new_kv, fresh=True))


def test_descriptor_reads_take_only_rows_they_can_address() -> None:
    rows = torch.zeros(8, 2, 32, dtype=torch.bfloat16)
    assert _reads_by_descriptor(rows, rows, 32, 32)
    assert not _reads_by_descriptor(rows.float(), rows.float(), 32, 32)  # 16-bit only
    assert not _reads_by_descriptor(rows, rows, 32, 64)  # heads narrower than the tile
    spread = torch.zeros(8, 2, 64, dtype=torch.bfloat16)[:, :, :32]
    assert not _reads_by_descriptor(rows, spread, 32, 32)  # a row's heads not contiguous
    odd = torch.zeros(8 * 2 * 32 + 1, dtype=torch.bfloat16)[1:].view(8, 2, 32)
    assert not _reads_by_descriptor(odd, rows, 32, 32)  # not 16-byte aligned


def test_descriptor_reads_are_the_default_only_where_tma_exists() -> None:
    assert not _has_tma(torch.device("cpu"))
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] >= 9
        assert _has_tma(torch.device("cuda", torch.cuda.current_device())) == hopper


_COMPILE = r"""
from tests.kernels.hopper_compile import compile_for_hopper
from muse.kernels.paged_attention_triton import _prefill_kernel

compile_for_hopper(_prefill_kernel,
                   dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16",
                        tables_ptr="*i64", first_block_ptr="*i64", seq_lens_ptr="*i64",
                        query_start_ptr="*i64", k_scale_ptr="*bf16", v_scale_ptr="*bf16",
                        k_new_ptr="*bf16", v_new_ptr="*bf16", scale_log2="fp32"),
                   dict(GROUP=4, HEAD_DIM=128, BLOCK_G=4, BLOCK_Q=32, BLOCK_D=128,
                        BLOCK_N=128, BLOCK_SIZE=16, SLIDING=True, PRECISION="tf32", FP8=False,
                        FRESH=True, KV_WIDTH=512, PDL=True),
                   set(), num_warps=8, num_stages=3)
print("compiled")
"""


def test_descriptor_reads_compile_for_hopper() -> None:
    assert_script_compiles(_COMPILE)

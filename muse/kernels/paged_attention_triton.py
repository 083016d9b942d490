"""Attention of a batch of new tokens over a paged KV cache, in Triton.

Same contract and result as `muse.kernels.paged_attention.paged_attention` (the torch twin),
with two kernels chosen by the step's shape:

* Decode (every request brings one query token): flash-decoding. One program per
  (request, kv head, split) loads the whole GQA group of query heads that share the kv head as
  the M rows of `tl.dot`, so each K/V page is read once per kv head rather than once per query
  head. Each split walks its own contiguous slice of the block table and writes a partial
  (max, sum, accumulator) to a float32 workspace; a small second kernel merges the splits.
  The split count depends only on tensor shapes, so the call can be captured in a CUDA graph.
* Prefill / extend (some request brings several tokens, possibly next to decodes): flash
  attention over the paged keys. One program per (request, query tile, kv head); the tile's
  BLOCK_Q tokens times the group's heads form the M rows. Programs whose tile lies past their
  request's query length exit at once; the key loop stops at the tile's last causal key.
  Steps whose requests bring at most `SHORT_QUERY_LEN` tokens (speculative verification) run
  the decode kernel instead, one decode per token.

Both kernels address keys by their position relative to the request's first table block, turn
it into (table entry, offset in page) and mask by absolute position, so null-block padding and
stale slots past seq_len are never read. Sliding layers start their key loop at the first key
inside the window, so blocks that have left the window cost nothing.

An FP8 cache (`fp8(k / k_scale)`, see the twin) is dequantized in the kernels: K/V pages load
as FP8 (half the bytes of BF16) and widen exactly to the query's dtype for the dots, the K
scale of the program's kv head multiplies the scores and the V scale the output, which is
the product with the dequantized K and V in two multiplies instead of one per element. The
scales are loaded from the device, so captured graphs follow scales set after capture.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from muse.kernels.attention_metadata import BatchMetadata, KindMetadata
from muse.kernels.paged_attention import check_kv_scales
from muse.kernels.pdl import pdl_options, start_dependent_kernel

# Scores are kept in base 2 (the softmax scale is multiplied by log2(e)) so the kernels can
# use exp2, one hardware instruction, instead of exp.
_LOG2E = 1.4426950408889634


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One key tile of a flash-attention loop: scores s [M, N] (log2-scaled, masked keys at
    -inf, at least one finite per row) folded into the running max m_i, sum l_i and output
    acc [M, D] with the tile's values v [N, D]; returns the new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, table_ptr, rel, valid, d_mask, offs_d, kv_head,
                  stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  BLOCK_SIZE: tl.constexpr):
    """K and V rows of keys at positions `rel` (relative to the table's first block) of one kv
    head, through the block table; rows where `valid` is false read as zeros."""
    block = tl.load(table_ptr + rel // BLOCK_SIZE, mask=valid, other=0)
    slot = rel % BLOCK_SIZE
    kv_mask = valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr,
        tables_ptr, first_block_ptr, seq_lens_ptr, query_start_ptr, k_scale_ptr, v_scale_ptr,
        scale_log2, window, table_width, num_heads,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_table,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
        FP8: tl.constexpr, PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + request)
    # A request without tokens (padding) has no output row of its own: writing would clobber
    # the next request's row.
    if tl.load(query_start_ptr + request + 1) == q_row:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    base = tl.load(first_block_ptr + request) * BLOCK_SIZE  # absolute position of key 0

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    # The keys the query sees, relative to `base`. The single query sits at seq_len - 1, so
    # causality is just "key < seq_len" and the window is "key >= seq_len - window".
    first = 0
    if SLIDING:
        first = tl.maximum(seq_len - window - base, 0)
    last = tl.minimum(seq_len - base, table_width * BLOCK_SIZE)
    # The splits share this request's keys evenly, in whole BLOCK_N tiles. The share is
    # computed here from seq_len, not on the host from the table width: a captured graph's
    # tables are as wide as the longest context, and a share sized by that width would leave
    # a short request's keys to one or two splits walking them serially.
    share = tl.cdiv(tl.cdiv(tl.maximum(last - first, 1), NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * share
    hi = tl.minimum(lo + share, last)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        rel = start + offs_n
        valid = rel < hi
        k, v = _load_kv_tile(k_ptr, v_ptr, tables_ptr + request * stride_table, rel, valid,
                             d_mask, offs_d, kv_head, stride_kb, stride_ks, stride_kh,
                             stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        k, v = k.to(q.dtype), v.to(q.dtype)  # exact from FP8; a no-op otherwise
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        # Every iteration has at least one valid key (start < hi).
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, PRECISION)
    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)

    if NUM_SPLITS == 1:
        # Nothing to merge: normalise here and skip the combine launch.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Workspace rows are (request, head, split); an empty split leaves (-inf, 0, 0).
        row = (request * num_heads + heads) * NUM_SPLITS + split
        tl.store(ws_m_ptr + row, m_i, mask=g_mask)
        tl.store(ws_l_ptr + row, l_i, mask=g_mask)
        tl.store(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _split_kv_combine_kernel(
        out_ptr, ws_acc_ptr, ws_m_ptr, ws_l_ptr, query_start_ptr, num_heads,
        stride_ot, stride_oh,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    start_dependent_kernel(PDL)
    request = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + request)
    if tl.load(query_start_ptr + request + 1) == q_row:
        return
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    row = (request * num_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(ws_m_ptr + row, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ws_l_ptr + row, mask=s_mask, other=0.0)
    acc = tl.load(ws_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    m_max = tl.max(m, 0)
    # All splits empty (a row that sees no key) -> weights 0 and output 0, not NaN.
    weight = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(l_s * weight, 0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + q_row * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k, v, q_pos, key_pos, valid, window, scale_log2,
                 MASKED: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr):
    """One online-softmax step over a tile of keys k / values v [BLOCK_N, BLOCK_D] at
    absolute positions key_pos.

    MASKED=False is for tiles every query row sees whole (below the causal diagonal, inside
    every row's window): no position tests at all, which is most of the work at long
    contexts."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # exact from FP8; a no-op otherwise
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    if MASKED:
        allowed = valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed &= key_pos[None, :] > q_pos[:, None] - window
        s = tl.where(allowed, s, float("-inf"))
    # A row can see no key of a masked tile (window already past it, or not yet reached),
    # so m_new may be -inf: shift by 0 then, which keeps exp2 at 0 instead of NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _page_keys(acc, m_i, l_i, q, q_pos, begin, end, offs_n, base, window, table_ptr,
               k_ptr, v_ptr, d_mask, offs_d, kv_head, scale_log2,
               stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
               BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
               SLIDING: tl.constexpr, PRECISION: tl.constexpr):
    """The keys at relative positions begin..end, BLOCK_N a step, read through the block
    table."""
    for start in range(begin, end, BLOCK_N):
        rel = start + offs_n
        valid = rel < end
        k, v = _load_kv_tile(k_ptr, v_ptr, table_ptr, rel, valid, d_mask, offs_d, kv_head,
                             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                             BLOCK_SIZE)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, q_pos, base + rel, valid, window,
                                     scale_log2, MASKED, SLIDING, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _fresh_keys(acc, m_i, l_i, q, q_pos, begin, end, offs_n, base, window, k_desc, v_desc,
                row0, column, scale_log2, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                SLIDING: tl.constexpr, PRECISION: tl.constexpr):
    """The same keys read from this step's K/V rows with tensor-memory-accelerator copies:
    the request has no cached context, so key position p is its row row0 + p. Rows past the
    range (the next request's, or none: read as zeros) are masked like keys past `end`."""
    for start in range(begin, end, BLOCK_N):
        rel = start + offs_n
        row = (row0 + base + start).to(tl.int32)  # descriptor coordinates are 32-bit
        k = k_desc.load([row, column])
        v = v_desc.load([row, column])
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, q_pos, base + rel, rel < end,
                                     window, scale_log2, MASKED, SLIDING, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, first_block_ptr, seq_lens_ptr,
        query_start_ptr, k_scale_ptr, v_scale_ptr, scale_log2, window, table_width,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_table,
        k_new_ptr, v_new_ptr, num_tokens, stride_knt, stride_vnt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, SLIDING: tl.constexpr, PRECISION: tl.constexpr,
        FP8: tl.constexpr, FRESH: tl.constexpr, KV_WIDTH: tl.constexpr, PDL: tl.constexpr):
    """FRESH: requests without cached context read their keys and values from this step's
    rows (k_new_ptr / v_new_ptr [num_tokens, KV_WIDTH], rows in the order of q) through
    tensor descriptors instead of gathering them page by page from the cache."""
    start_dependent_kernel(PDL)
    request = tl.program_id(0)
    # Causal tiles further down the prompt see more keys: the grid hands them out first, so
    # the short ones fill in at the end instead of the long ones trailing alone.
    tile = tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head = tl.program_id(2)
    q_row0 = tl.load(query_start_ptr + request)
    q_len = tl.load(query_start_ptr + request + 1) - q_row0
    # The grid is sized for the longest request; shorter ones have nothing in this tile.
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + request)
    base = tl.load(first_block_ptr + request) * BLOCK_SIZE

    # Row m of the tile is token m // BLOCK_G, head m % BLOCK_G of the group.
    offs_m = tl.arange(0, BLOCK_Q * BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    token = tile * BLOCK_Q + offs_m // BLOCK_G
    group_index = offs_m % BLOCK_G
    row_mask = (token < q_len) & (group_index < GROUP)
    d_mask = offs_d < HEAD_DIM
    q_pos = seq_len - q_len + token
    q_offsets = (q_row0 + token)[:, None] * stride_qt \
        + (kv_head * GROUP + group_index)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr + kv_head)
    else:
        q = q.to(k_ptr.dtype.element_ty)

    # Keys this tile can see, relative to `base`: up to its last real query (causal), from
    # the window start of its first query (sliding). Keys in [full_lo, full_hi) are seen by
    # every row: at or before the first query, inside the last query's window.
    first_pos = seq_len - q_len + tile * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    hi = tl.minimum(last_pos + 1 - base, table_width * BLOCK_SIZE)
    lo = 0
    full_lo = 0
    if SLIDING:
        lo = tl.maximum(first_pos - window + 1 - base, 0)
        full_lo = tl.minimum(tl.maximum(last_pos - window + 1 - base, 0), hi)
    full_hi = tl.minimum(first_pos + 1 - base, hi)
    full_end = full_lo + tl.maximum(full_hi - full_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    table_ptr = tables_ptr + request * stride_table
    # Each source has its own loops: a branch inside a loop body would keep Triton from
    # pipelining the loads across iterations. The key ranges: the lower edge of the window
    # (partly masked), the keys every row sees whole, the causal diagonal (masked).
    if FRESH and seq_len == q_len:
        k_desc = tl.make_tensor_descriptor(k_new_ptr, shape=[num_tokens, KV_WIDTH],
                                           strides=[stride_knt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        v_desc = tl.make_tensor_descriptor(v_new_ptr, shape=[num_tokens, KV_WIDTH],
                                           strides=[stride_vnt, 1],
                                           block_shape=[BLOCK_N, BLOCK_D])
        rows = (k_desc, v_desc, q_row0, (kv_head * HEAD_DIM).to(tl.int32), scale_log2)
        if SLIDING:
            acc, m_i, l_i = _fresh_keys(acc, m_i, l_i, q, q_pos, lo, full_lo, offs_n, base,
                                        window, *rows, BLOCK_N, True, SLIDING, PRECISION)
        acc, m_i, l_i = _fresh_keys(acc, m_i, l_i, q, q_pos, full_lo, full_end, offs_n, base,
                                    window, *rows, BLOCK_N, False, SLIDING, PRECISION)
        acc, m_i, l_i = _fresh_keys(acc, m_i, l_i, q, q_pos, full_end, hi, offs_n, base,
                                    window, *rows, BLOCK_N, True, SLIDING, PRECISION)
    else:
        pages = (table_ptr, k_ptr, v_ptr, d_mask, offs_d, kv_head, scale_log2, stride_kb,
                 stride_ks, stride_kh, stride_vb, stride_vs, stride_vh)
        if SLIDING:
            acc, m_i, l_i = _page_keys(acc, m_i, l_i, q, q_pos, lo, full_lo, offs_n, base,
                                       window, *pages, BLOCK_N, BLOCK_SIZE, True, SLIDING,
                                       PRECISION)
        acc, m_i, l_i = _page_keys(acc, m_i, l_i, q, q_pos, full_lo, full_end, offs_n, base,
                                   window, *pages, BLOCK_N, BLOCK_SIZE, False, SLIDING,
                                   PRECISION)
        acc, m_i, l_i = _page_keys(acc, m_i, l_i, q, q_pos, full_end, hi, offs_n, base,
                                   window, *pages, BLOCK_N, BLOCK_SIZE, True, SLIDING,
                                   PRECISION)

    if FP8:
        acc = acc * tl.load(v_scale_ptr + kv_head)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_offsets = (q_row0 + token)[:, None] * stride_ot \
        + (kv_head * GROUP + group_index)[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def _precision(dtype: torch.dtype) -> str:
    # float32 callers expect float32 accuracy; the default TF32 would cost ~1e-3 relative.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM; only matters for the CPU interpreter, which runs tests


# Decode: 64 keys (four 16-token pages) per iteration keeps the K/V loads wide enough to be
# bandwidth-bound rather than latency-bound, and a split shorter than 256 keys does too
# little work to pay for its share of the combine. Two CTAs per SM is enough to saturate HBM.
_DECODE_BLOCK_N = 64
_DECODE_MIN_KEYS_PER_SPLIT = 256
_DECODE_MAX_SPLITS = 64


def _decode_splits(num_requests: int, num_kv_heads: int, table_width: int, block_size: int,
                   block_n: int, device: torch.device) -> int:
    """The split count, from shapes only (the table width bounds every context); the kernel
    divides each request's actual keys evenly between the splits."""
    tiles = max(1, -(-table_width * block_size // block_n))
    by_length = -(-tiles * block_n // _DECODE_MIN_KEYS_PER_SPLIT)
    by_occupancy = max(1, 2 * _sm_count(device) // (num_requests * num_kv_heads))
    return max(1, min(by_length, by_occupancy, _DECODE_MAX_SPLITS))


def _common(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int, int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    # tl.dot needs every dimension >= 16 and power-of-two tiles; padding is masked off.
    block_d = max(16, triton.next_power_of_2(head_dim))
    return num_heads, head_dim, group, block_d


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            meta: BatchMetadata, kind: KindMetadata, sliding_window: int | None, scale: float,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            num_splits: int | None = None, block_n: int = _DECODE_BLOCK_N) -> torch.Tensor:
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    num_heads, head_dim, group, block_d = _common(q, k_cache)
    num_requests, num_kv_heads = meta.num_requests, k_cache.shape[2]
    table_width = kind.block_tables.shape[1]
    splits = num_splits or _decode_splits(num_requests, num_kv_heads, table_width,
                                          meta.block_size, block_n, q.device)
    out = torch.empty_like(q)
    ws_acc = torch.empty(num_requests, num_heads, splits, head_dim, dtype=torch.float32,
                         device=q.device) if splits > 1 else out
    ws_m = torch.empty(num_requests, num_heads, splits, dtype=torch.float32,
                       device=q.device) if splits > 1 else out
    ws_l = torch.empty_like(ws_m) if splits > 1 else out
    tables = kind.block_tables
    _decode_kernel[(num_requests, num_kv_heads, splits)](
        q, k_cache, v_cache, out, ws_acc, ws_m, ws_l,
        tables, kind.first_block, meta.seq_lens, meta.query_start,
        k_scale if fp8 else out, v_scale if fp8 else out,
        scale * _LOG2E, sliding_window or 0, table_width, num_heads,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim,
        # The group's heads are the M rows of tl.dot, padded to its 16-row minimum.
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        BLOCK_SIZE=meta.block_size, NUM_SPLITS=splits, SLIDING=sliding_window is not None,
        PRECISION=_precision(q.dtype), FP8=fp8,
        # Decode is a stream of K/V: 4 warps cover a 16 x 64 tile, and a second stage lets
        # the next pages load while this one is reduced.
        num_warps=4, num_stages=2, **pdl_options(q.device))
    if splits > 1:
        _split_kv_combine_kernel[(num_requests, num_heads)](
            out, ws_acc, ws_m, ws_l, meta.query_start, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits,
            BLOCK_S=triton.next_power_of_2(splits), num_warps=1, **pdl_options(q.device))
    return out


# Prefill requests without cached context read this step's K/V rows through tensor
# descriptors (`_fresh_keys`, Hopper's TMA copies) instead of gathering them from the cache
# pages: 8K-token prefill 13-21% faster on the H200 (docs/performance.md). On by default on
# sm_90 and newer; `MUSE_PREFILL_TMA=0` turns it off.
PREFILL_TMA = os.environ.get("MUSE_PREFILL_TMA", "1") == "1"


@functools.cache
def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _reads_by_descriptor(k: torch.Tensor, v: torch.Tensor, head_dim: int,
                         block_d: int) -> bool:
    """Whether K/V rows [tokens, kv_heads, head_dim] can be read as 2D tensor descriptors:
    16-bit, each row's heads contiguous, 16-byte aligned rows, heads as wide as the tile."""
    def fits(x: torch.Tensor) -> bool:
        size = x.element_size()
        return (size == 2 and x.stride(2) == 1 and x.stride(1) == head_dim
                and x.stride(0) * size % 16 == 0 and x.data_ptr() % 16 == 0)
    return head_dim == block_d and fits(k) and fits(v)


@functools.cache
def _set_descriptor_allocator() -> None:
    """Descriptors built in a kernel need global scratch memory, which Triton asks of the
    allocator set here (torch's, so CUDA graphs capture it in their pool)."""
    def allocate(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device="cuda")
    triton.set_allocator(allocate)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: BatchMetadata, kind: KindMetadata, sliding_window: int | None, scale: float,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             block_m: int | None = None, block_n: int | None = None,
             num_warps: int | None = None, num_stages: int | None = None,
             new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
             fresh: bool | None = None) -> torch.Tensor:
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    _, head_dim, group, block_d = _common(q, k_cache)
    num_requests, num_kv_heads = meta.num_requests, k_cache.shape[2]
    wide = q.element_size() >= 4
    # 16-bit inputs: 128 query rows x 128 keys, 8 warps, 3 stages, measured on the H200
    # (`benchmarks/tune_kernels.py`: 26-28% faster than 128 x 64 with 2 stages for an 8K
    # chunk after 0 or 24K cached tokens). Three stages of 128-key K and V tiles need 192 KB
    # of shared memory at head_dim 128, so wider heads take 64 keys. float32 runs its dots
    # on FMA units at IEEE precision, so its tiles are smaller to bound registers.
    narrow_heads = block_d <= 128
    block_m = block_m or (64 if wide else 128)
    block_n = block_n or (32 if wide else 128 if narrow_heads else 64)
    if num_stages is None:
        num_stages = 3 if not wide and narrow_heads else 2
    block_g = triton.next_power_of_2(group)
    block_q = max(block_m // block_g, -(-16 // block_g))  # at least 16 rows for tl.dot
    tables = kind.block_tables
    out = torch.empty_like(q)
    if fresh is None:
        fresh = PREFILL_TMA and _has_tma(q.device)
    # The rows must be the values the cache holds: the same dtype, not FP8-rounded.
    fresh = (fresh and not fp8 and new_kv is not None and new_kv[0].dtype == k_cache.dtype
             and _reads_by_descriptor(*new_kv, head_dim, block_d))
    k_new, v_new = new_kv if fresh else (out, out)
    if fresh and q.is_cuda:
        _set_descriptor_allocator()
    grid = (num_requests, -(-meta.max_query_len // block_q), num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, tables, kind.first_block, meta.seq_lens, meta.query_start,
        k_scale if fp8 else out, v_scale if fp8 else out, scale * _LOG2E, sliding_window or 0,
        tables.shape[1],
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        out.stride(0), out.stride(1), tables.stride(0),
        k_new, v_new, k_new.shape[0], k_new.stride(0), v_new.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_D=block_d,
        BLOCK_N=block_n, BLOCK_SIZE=meta.block_size, SLIDING=sliding_window is not None,
        PRECISION=_precision(q.dtype), FP8=fp8, FRESH=fresh,
        KV_WIDTH=k_new.shape[1] * head_dim if fresh else head_dim,
        # 4 warps spill registers on these full-size tiles; 8 hold the accumulator, the scores
        # and the probabilities. The stages overlap the next K/V pages with this tile's math.
        num_warps=num_warps or (8 if block_q * block_g >= 64 else 4), num_stages=num_stages,
        **pdl_options(q.device))
    return out


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: BatchMetadata, kind: KindMetadata, sliding_window: int | None,
                           scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           new_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                           ) -> torch.Tensor:
    """q [tokens, heads, head_dim] -> [tokens, heads, head_dim]; caches [blocks, bs, kv, dim];
    an FP8 cache with float32 scales [kv_heads] (see the twin). new_kv: this step's K and V
    [tokens, kv_heads, head_dim], rows in the order of q, already written to the cache; a
    prefill may read a request's keys from them when it has no cached context.

    Launches only: no host sync and no value-dependent shapes, so decode steps can be
    captured in a CUDA graph.
    """
    assert q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
    # The kernels step along head_dim with unit stride (the caches are always laid out so).
    if q.stride(2) != 1:
        q = q.contiguous()
    if meta.max_query_len == 1:
        return _decode(q, k_cache, v_cache, meta, kind, sliding_window, scale, k_scale,
                       v_scale)
    if meta.max_query_len <= SHORT_QUERY_LEN:
        return _decode(q, k_cache, v_cache, *_per_token(meta, kind), sliding_window, scale,
                       k_scale, v_scale)
    return _prefill(q, k_cache, v_cache, meta, kind, sliding_window, scale, k_scale, v_scale,
                    new_kv=new_kv)


# Steps whose requests bring at most this many queries (speculative verification: 1 + k)
# attend as decodes, one per token. The prefill kernel gives a request one program per kv head
# and walks its keys alone, which leaves the GPU nearly idle over a long context; the decode
# kernel splits the keys over the SMs.
SHORT_QUERY_LEN = 16


def _per_token(meta: BatchMetadata, kind: KindMetadata) -> tuple[BatchMetadata, KindMetadata]:
    """The step as one decode per token: token i sees its request's keys up to its own
    position (the step's K/V is written before attention), through its request's table."""
    key = id(kind)
    cached = meta.per_token.get(key)
    if cached is None:
        tokens = meta.positions.shape[0]
        rows = torch.arange(tokens + 1, device=meta.positions.device)
        cached = (dataclasses.replace(meta, token_request=rows[:tokens], query_start=rows,
                                      per_token={},
                                      seq_lens=meta.positions + 1, max_query_len=1),
                  KindMetadata(kind.slot_mapping, kind.block_tables[meta.token_request],
                               kind.first_block[meta.token_request]))
        meta.per_token[key] = cached  # the layers of one kind share it
    return cached

"""Attention of a batch of new tokens over a paged KV cache, in plain PyTorch.

This is the portable path (CPU, tests) and the twin that faster GPU kernels are checked against.
It handles prefill chunks and decodes in one call: queries are padded per request, each
request's keys are gathered from its block table, and masks come from positions.

FP8 KV cache: a cache of dtype float8_e4m3fn holds `fp8(k / k_scale)` (and likewise V), with
`k_scale` / `v_scale` float32 multipliers per kv head, shape [kv_heads] (a per-tensor scale is
the same value in every entry). Stores divide and saturate at +-448; attention multiplies the
loaded values back. Caches of any other dtype ignore the scales.
"""

from __future__ import annotations

import torch

from muse.kernels.attention_metadata import BatchMetadata, KindMetadata

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max  # 448


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, kv_heads, head_dim] -> fp8(x / scale), saturated at the format's range."""
    scaled = x.float() / scale.float()[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of cache entries [..., kv_heads, head_dim] stored by `quantize_kv`."""
    return stored.float() * scale.float()[:, None]


def check_kv_scales(cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> bool:
    """Whether the caches are FP8 (and so need both scales)."""
    if not is_fp8(cache):
        return False
    if k_scale is None or v_scale is None:
        raise ValueError("an FP8 KV cache needs `k_scale` and `v_scale`")
    return True


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys/values [tokens, kv_heads, head_dim] at their flat cache slots."""
    if check_kv_scales(k_cache, k_scale, v_scale):
        k, v = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: BatchMetadata, kind: KindMetadata, sliding_window: int | None,
                    scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q [tokens, heads, head_dim] -> [tokens, heads, head_dim]; caches [blocks, bs, kv, dim].

    new_kv (this step's K/V, already in the cache) is for kernels that can read them
    directly; the cache holds the same values, so this twin reads only the cache."""
    fp8 = check_kv_scales(k_cache, k_scale, v_scale)
    scales = (k_scale, v_scale) if fp8 else None
    if meta.max_query_len > 1 and q.device.type == "cpu":
        # A step that mixes decodes with a prefill chunk pads every decode to the chunk's
        # length: with many decodes beside a long chunk nearly all the work is padding. On the
        # CPU (where this twin is the engine's path) the two groups are attended apart; on a
        # GPU it stays one call, with no host sync, as the reference the kernels are checked
        # against.
        query_lens = meta.query_start[1:] - meta.query_start[:-1]
        decoding = query_lens == 1
        if bool(decoding.any()) and not bool(decoding.all()):
            out = torch.empty_like(q)
            for group in (decoding, ~decoding):
                tokens = group[meta.token_request]
                # The group's requests renumbered 0, 1, ... in their order.
                renumbered = torch.cumsum(group, 0) - 1
                lens = query_lens[group]
                out[tokens] = _padded_attention(
                    q[tokens], k_cache, v_cache, meta.positions[tokens],
                    renumbered[meta.token_request[tokens]], _offsets(lens), int(lens.max()),
                    meta.seq_lens[group], kind.block_tables[group], kind.first_block[group],
                    meta.block_size, sliding_window, scale, scales)
            return out
    return _padded_attention(q, k_cache, v_cache, meta.positions, meta.token_request,
                             meta.query_start, meta.max_query_len, meta.seq_lens,
                             kind.block_tables, kind.first_block, meta.block_size,
                             sliding_window, scale, scales)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """[n] lengths -> [n + 1] start offsets."""
    offsets = lengths.new_zeros(lengths.shape[0] + 1)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return offsets


def _padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      positions: torch.Tensor, token_request: torch.Tensor,
                      query_start: torch.Tensor, max_query: int, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, first_block: torch.Tensor, block_size: int,
                      sliding_window: int | None, scale: float,
                      scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Attention of the requests whose tokens q holds (request `token_request[t]`, those of a
    request from `query_start[r]` on), every request's queries padded to `max_query`."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    requests = seq_lens.shape[0]

    # Queries padded to [requests, max_query, kv_heads, group, dim].
    column = torch.arange(num_tokens, device=q.device) - query_start[token_request]
    padded_q = q.new_zeros(requests, max_query, num_heads, head_dim)
    padded_q[token_request, column] = q
    padded_q = padded_q.view(requests, max_query, num_kv_heads, group, head_dim)
    query_pos = torch.zeros(requests, max_query, dtype=torch.long, device=q.device)
    query_pos[token_request, column] = positions

    # Keys [requests, keys, kv_heads, dim] and the absolute position of each.
    keys = k_cache[block_tables].flatten(1, 2).float()
    values = v_cache[block_tables].flatten(1, 2).float()
    if scales is not None:
        keys, values = dequantize_kv(keys, scales[0]), dequantize_kv(values, scales[1])
    key_pos = first_block[:, None] * block_size + torch.arange(keys.shape[1], device=q.device)

    allowed = key_pos[:, None, :] <= query_pos[:, :, None]
    allowed &= key_pos[:, None, :] < seq_lens[:, None, None]
    if sliding_window is not None:
        allowed &= key_pos[:, None, :] > query_pos[:, :, None] - sliding_window
    scores = torch.einsum("rqkgd,rnkd->rkgqn", padded_q.float(), keys) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    # Padding rows see no key; zero them instead of producing NaN.
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    out = torch.einsum("rkgqn,rnkd->rqkgd", probs, values)
    out = out.reshape(requests, max_query, num_heads, head_dim)
    return out[token_request, column].to(q.dtype)

"""Top-k and top-p filtering of a batch of logits without sorting the vocabulary.

Both filters keep, per row, every token at or above a threshold:

* top-k: the threshold is the k-th largest logit, read off `torch.topk` with k the largest
  top_k of the batch (so the work scales with that k, not with the vocabulary).
* top-p: on the distribution left by top-k, a token is dropped when the tokens *strictly more
  likely* than it already reach top_p; the most likely token is always kept (top_p > 0). The
  mass strictly above a probability only falls as the probability grows, so the kept tokens are
  exactly those with prob >= t*, t* the smallest t with mass(prob > t) < top_p. Non-negative
  float32 values order like their int32 bit patterns, so t* is found exactly by bisection over
  those integers: 31 steps of a masked row sum, no sort, no data-dependent control flow.

Ties: tokens with equal logits (top-k) or equal probabilities (top-p) are kept or dropped
together -- all are kept when the first of them in sorted order would be -- so the result does
not depend on how a sort happens to order them. With distinct values the kept sets are those of
`top_k_top_p_filter_sort`, up to float32 rounding of the cumulative sums when top_p is within
rounding of one of them. (Over a large vocabulary the masked sums here, reduced pairwise, are
the closer of the two to the exact float64 kept set: a float32 cumsum drifts.)

Rows with top_k == 0 (or >= vocab) skip top-k; rows with top_p >= 1 skip top-p.
"""

from __future__ import annotations

import torch

# Probabilities are at most 1.0, whose float32 bit pattern 0x3F800000 is below 2**30; 31 halvings
# of [-1, bits(1.0)] always narrow the bisection to adjacent integers.
_BISECTION_STEPS = 31


def _top_k_mask(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Logits below each row's k-th largest logit set to -inf (top_k <= 0: row unchanged)."""
    vocab = logits.shape[-1]
    k_cap = min(max_top_k, vocab)
    largest = logits.topk(k_cap, dim=-1).values  # sorted, descending
    k = top_k.clamp(max=k_cap)
    kth = largest.gather(1, (k - 1).clamp(min=0)[:, None])
    unlimited = (k <= 0)[:, None] | (top_k >= vocab)[:, None]
    threshold = torch.where(unlimited, torch.full_like(kth, float("-inf")), kth)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p_mask(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens outside each row's nucleus set to -inf (top_p >= 1: row unchanged)."""
    probs = logits.softmax(dim=-1)
    bits = probs.view(torch.int32)  # non-negative floats: integer order == float order
    top_p = top_p.to(probs.dtype)[:, None]
    # Invariant: mass(bits > lo) >= top_p (or lo = -1) and mass(bits > hi) < top_p.
    lo = torch.full_like(top_p, -1, dtype=torch.int32)
    hi = bits.max(dim=-1, keepdim=True).values
    for _ in range(_BISECTION_STEPS):
        mid = lo + (hi - lo) // 2
        mass = torch.where(bits > mid, probs, 0.0).sum(dim=-1, keepdim=True)
        below = mass < top_p
        hi = torch.where(below, mid, hi)
        lo = torch.where(below, lo, mid)
    drop = (bits < hi) & (top_p < 1.0)
    return logits.masked_fill(drop, float("-inf"))


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, *,
                       max_top_k: int | None = None, any_top_p: bool | None = None
                       ) -> torch.Tensor:
    """logits [rows, vocab] float32 with the tokens top-k and then top-p drop set to -inf.

    top_k [rows] integer (0: no limit), top_p [rows] float in (0, 1]. `max_top_k` (the largest
    top_k, 0 if none) and `any_top_p` (whether some top_p < 1) let a caller that knows them on
    the host avoid a device synchronisation; when omitted they are read from the tensors.
    """
    if max_top_k is None:
        max_top_k = int(top_k.max()) if top_k.numel() else 0
    if any_top_p is None:
        any_top_p = bool((top_p < 1.0).any())
    if max_top_k > 0:
        logits = _top_k_mask(logits, top_k, max_top_k)
    if any_top_p:
        logits = _top_p_mask(logits, top_p)
    return logits


def top_k_top_p_filter_sort(logits: torch.Tensor, top_k: torch.Tensor,
                            top_p: torch.Tensor) -> torch.Tensor:
    """The same filter by sorting each row: the plain formulation the fast one is checked against.

    Ties are broken by sort order here, so with equal values it may keep fewer tokens.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the more likely ones already reach top_p (always keep the first). Rows
    # with top_p = 1 are left alone: a cumulative sum that rounds up to 1 must not cut the tail.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = (before >= top_p[:, None]) & (top_p < 1.0)[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

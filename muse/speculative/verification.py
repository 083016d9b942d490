"""Lossless verification of speculative drafts, batched over requests.

One target forward over `[anchor, x_1..x_g]` gives the target's distributions p_1..p_{g+1} at the
draft positions and at the bonus position. Verification keeps t of the g drafts (0 <= t <= g) and
emits one more token y, so that the emitted tokens follow exactly the law of sampling the target
token by token (greedy: exactly its argmax sequence).

Token-wise (Leviathan et al., Chen et al.): accept x_i with probability

    alpha_i = min(1, p_i(x_i) / q_i(x_i)),

stop at the first rejection i and emit y ~ norm(max(p_i - q_i, 0)); when all g pass, y ~ p_{g+1}.

Block (Sun et al.):

    w_0 = 1,   w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))
    R_i = sum_v max(w_i p_{i+1}(v) - q_{i+1}(v), 0)                    i = 0..g-1
    h_i = R_i / (R_i + (1 - w_i))  (1 when the denominator is 0)      i = 1..g-1,   h_g = w_g

t is the LAST i whose test eta_i < h_i passes (all g tests are drawn; no early stop), 0 when none
does; then y ~ norm(max(w_t p_{t+1} - q_{t+1}, 0)) if t < g (the residual weighted by w_t), or the
bonus y ~ p_{g+1} if t = g. Never fewer accepted tokens on average than token-wise; the same law
when drafts are one-hot.

Shapes: R requests, G = the largest draft count of the batch, V the vocabulary.

    target_probs  [R, G+1, V]  p_1..p_{G+1}, after the request's logits processors (temperature,
                               top-k / top-p, penalties, grammar masks). Request r reads only
                               p_1..p_{g_r+1}.
    draft_tokens  [R, G] long  x_1..x_G; positions past g_r are padding (any value)
    num_drafts    [R] long     g_r in 0..G
    draft_probs   [R, G, V]    q_i, the exact distribution x_i was drawn from, or None for one-hot
                               drafts (greedy drafters, n-gram and suffix speculators)
    uniforms      [R, G]       U[0, 1) draws for the tests
    exponentials  [R, V]       Exp(1) draws for the final token: y = argmax(dist / E) is an exact
                               draw from dist / sum(dist) (the exponential race)

The noise is an input so that the caller keeps the RNG policy (per-request generators keyed by
seed and position). Outputs: `num_accepted` [R] (t) and `output_tokens` [R, G+1] holding
x_1..x_t, y, then -1. Everything stays on the input device with no host sync; the math runs in
float32 (float64 inputs stay float64). Padding never reaches a result: padded positions are
masked with `torch.where`, which drops whatever NaN or out-of-range value they hold.

`verification_law` returns the per-position quantities (the test probabilities and the law of the
final token for every t) from the same code the samplers run, and `accepted_count` the rule that
turns test outcomes into t, so the exact law of a verification step can be enumerated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

Method = Literal["token", "block"]


class VerificationLaw(NamedTuple):
    """Per-position quantities that fix the law of one verification step."""

    accept_probs: torch.Tensor  # [R, G]: P(test i passes): alpha_i or h_i; 0 past g_r
    final_probs: torch.Tensor  # [R, G+1, V]: law of y given t = j (normalised); 0 for j > g_r


@dataclass
class _Drafts:
    """The inputs of one batch in the compute dtype, with padding made harmless."""

    p: torch.Tensor  # [R, G+1, V]
    q: torch.Tensor | None  # [R, G, V]; None: one-hot at `tokens`
    tokens: torch.Tensor  # [R, G] long; padding replaced by 0 so that gathers stay in range
    num: torch.Tensor  # [R] long
    valid: torch.Tensor  # [R, G] bool: position i (0-based) < g_r
    p_at: torch.Tensor  # [R, G]: p_i(x_i)
    q_at: torch.Tensor  # [R, G]: q_i(x_i) (1 for one-hot drafts)


def _valid_positions(num_drafts: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] bool: 0-based position < num_drafts."""
    return torch.arange(width, device=num_drafts.device) < num_drafts[..., None]


def _prepare(target_probs: torch.Tensor, draft_tokens: torch.Tensor, num_drafts: torch.Tensor,
             draft_probs: torch.Tensor | None) -> _Drafts:
    # At least float32: the acceptance tests compare ratios of small probabilities, and the
    # residuals are differences of nearly equal ones; bfloat16 would round both coarsely.
    dtype = torch.promote_types(target_probs.dtype, torch.float32)
    p = target_probs.to(dtype)
    width = draft_tokens.shape[1]
    num = num_drafts.to(torch.long)
    valid = _valid_positions(num, width)
    tokens = torch.where(valid, draft_tokens.to(torch.long), 0)
    p_at = p[:, :width].gather(-1, tokens[..., None])[..., 0]
    if draft_probs is None:
        q = None
        q_at = torch.ones_like(p_at)
    else:
        q = draft_probs.to(dtype)
        q_at = q.gather(-1, tokens[..., None])[..., 0]
    return _Drafts(p=p, q=q, tokens=tokens, num=num, valid=valid, p_at=p_at, q_at=q_at)


def _capped_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """min(1, numerator / denominator).

    q_i(x_i) = 0 cannot happen for a token drawn from q_i; should it anyway, the token is accepted
    only if the target gives it mass, so that a zero-probability token is never emitted.
    """
    ratio = (numerator / denominator).clamp(max=1.0)
    return torch.where(denominator > 0, ratio, (numerator > 0).to(numerator.dtype))


def _residual(p: torch.Tensor, weight: torch.Tensor, q: torch.Tensor | None,
              tokens: torch.Tensor) -> torch.Tensor:
    """max(weight * p - q, 0) over the last dimension; q one-hot at `tokens` when None.

    One-hot q subtracts 1 at the drafted token only, so it is applied there by a scatter rather
    than materialised as a [.., V] tensor.
    """
    scaled = weight[..., None] * p
    if q is not None:
        return (scaled - q).clamp(min=0.0)
    index = tokens[..., None]
    at_token = scaled.gather(-1, index)
    return scaled.scatter(-1, index, (at_token - 1.0).clamp(min=0.0))


def _tokenwise_acceptance(d: _Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """alpha_i = min(1, p_i(x_i) / q_i(x_i)); residual weights all 1 (token-wise never scales)."""
    alpha = torch.where(d.valid, _capped_ratio(d.p_at, d.q_at), 0.0)
    return alpha, torch.ones_like(d.p[..., 0])


def _block_acceptance(d: _Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """h_1..h_G and the weights w_0..w_G of block verification.

    w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)) is a clamped running product: a scan over the G
    draft positions, each step vectorised over the requests.
    """
    weights = [torch.ones_like(d.p[:, 0, 0])]
    for i in range(d.p_at.shape[1]):
        weights.append(_capped_ratio(weights[-1] * d.p_at[:, i], d.q_at[:, i]))
    w = torch.stack(weights, dim=1)  # [R, G+1]: w_0..w_G
    width = d.tokens.shape[1]
    # R_i for i = 0..G-1 from p_{i+1}, q_{i+1}: both live at 0-based index i.
    mass = _residual(d.p[:, :width], w[:, :width], d.q, d.tokens).sum(dim=-1)
    w_i = w[:, 1:]  # w_1..w_G
    r_i = F.pad(mass[:, 1:], (0, 1))  # R_1..R_{G-1}, then a placeholder for i = G
    # 1 - w first: it is exact for w near 1, and R + (1 - w) keeps a small R that (R + 1) - w
    # would round away against the 1.
    denominator = r_i + (1.0 - w_i)
    h = torch.where(denominator > 0, r_i / denominator, 1.0)
    positions = torch.arange(1, width + 1, device=d.num.device)[None, :]
    last = positions == d.num[:, None]
    h = torch.where(last, w_i, h).clamp(0.0, 1.0)  # h_g = w_g
    return torch.where(d.valid, h, 0.0), w


def _acceptance(method: Method, d: _Drafts) -> tuple[torch.Tensor, torch.Tensor]:
    """(P(test i passes) [R, G], residual weight for each t [R, G+1])."""
    if method == "token":
        return _tokenwise_acceptance(d)
    if method == "block":
        return _block_acceptance(d)
    raise ValueError(f"unknown verification method {method!r}")


def _leading_passed(passed: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of passed tests (token-wise: stop at the first rejection)."""
    return passed.to(torch.long).cumprod(dim=-1).sum(dim=-1)


def _last_passed(passed: torch.Tensor) -> torch.Tensor:
    """1-based index of the last passed test, 0 when none (block: a later pass overrides an
    earlier failure, so there is no early stop)."""
    width = passed.shape[-1]
    # A column for i = 0 that always passes (h_0 = 1) also keeps the max defined when G = 0.
    always = passed.new_ones((*passed.shape[:-1], 1))
    indices = torch.arange(width + 1, device=passed.device)
    return torch.where(torch.cat([always, passed], dim=-1), indices, 0).amax(dim=-1)


def accepted_count(method: Method, passed: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """t from the outcomes of the tests `passed` [..., G] (bool); positions past g_r never pass."""
    passed = passed & _valid_positions(num_drafts, passed.shape[-1])
    if method == "token":
        return _leading_passed(passed)
    if method == "block":
        return _last_passed(passed)
    raise ValueError(f"unknown verification method {method!r}")


def _final_distribution(d: _Drafts, t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Unnormalised law of the final token given t [R]: the residual
    max(w_t p_{t+1} - q_{t+1}, 0) when t < g (w_t = 1 token-wise), p_{g+1} when t = g."""
    rows = torch.arange(t.shape[0], device=t.device)
    target = d.p[rows, t]  # p_{t+1}
    width = d.tokens.shape[1]
    if width == 0:
        return target
    i = t.clamp(max=width - 1)  # t = G reads a real row; it takes the bonus branch below
    q = None if d.q is None else d.q[rows, i]
    residual = _residual(target, weights[rows, t], q, d.tokens[rows, i])
    # t < g is reached with probability proportional to the residual mass; if rounding leaves
    # none, the choice has probability zero and p_{t+1} is as good as any, and better than
    # the arbitrary token an all-zero race would return.
    use_residual = (t < d.num) & (residual.sum(dim=-1) > 0)
    return torch.where(use_residual[:, None], residual, target)


def _race(dist: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """argmax(dist / E): an exact draw from dist / sum(dist) for i.i.d. E ~ Exp(1).

    Tokens without mass score -1, below every token with mass, so that neither an E of 0
    (0 / 0 = NaN, which argmax would pick) nor an underflowing dist / E can select them.
    """
    score = torch.where(dist > 0, dist / exponentials.to(dist.dtype), -1.0)
    return score.argmax(dim=-1)


def _assemble(draft_tokens: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[R, G+1]: x_1..x_t, y, then -1."""
    positions = torch.arange(draft_tokens.shape[1] + 1, device=t.device)[None, :]
    drafts = F.pad(draft_tokens.to(torch.long), (0, 1), value=-1)
    out = torch.where(positions < t[:, None], drafts, -1)
    return torch.where(positions == t[:, None], y[:, None], out)


def _verify(method: Method, target_probs: torch.Tensor, draft_tokens: torch.Tensor,
            num_drafts: torch.Tensor, draft_probs: torch.Tensor | None, uniforms: torch.Tensor,
            exponentials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = _prepare(target_probs, draft_tokens, num_drafts, draft_probs)
    accept, weights = _acceptance(method, d)
    # u < a, not u <= a: for u uniform on [0, 1) (on a float grid too) P(u < a) = a exactly,
    # and a test with probability 0 never passes.
    passed = uniforms < accept
    t = accepted_count(method, passed, d.num)
    y = _race(_final_distribution(d, t, weights), exponentials)
    return t, _assemble(draft_tokens, t, y)


def verify_tokenwise(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                     uniforms: torch.Tensor, exponentials: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-wise rejection sampling: x_i kept with probability min(1, p_i(x_i) / q_i(x_i))
    until the first rejection, which emits y ~ norm(max(p_i - q_i, 0)); all g kept: y ~ p_{g+1}.

    Returns (num_accepted [R], output_tokens [R, G+1]); see the module docstring for shapes.
    """
    return _verify("token", target_probs, draft_tokens, num_drafts, draft_probs, uniforms,
                   exponentials)


def verify_block(target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                 num_drafts: torch.Tensor, draft_probs: torch.Tensor | None,
                 uniforms: torch.Tensor, exponentials: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification: t = the last i with eta_i < h_i (0 if none), then
    y ~ norm(max(w_t p_{t+1} - q_{t+1}, 0)) if t < g, y ~ p_{g+1} if t = g.

    Returns (num_accepted [R], output_tokens [R, G+1]); see the module docstring for shapes.
    """
    return _verify("block", target_probs, draft_tokens, num_drafts, draft_probs, uniforms,
                   exponentials)


def verify_greedy(target_scores: torch.Tensor, draft_tokens: torch.Tensor,
                  num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy target: keep the longest prefix with x_i = argmax p_i, then emit argmax p_{t+1}.

    `target_scores` [R, G+1, V] may be logits or probabilities (only the argmax is used; ties go
    to the lowest index, as `torch.argmax`). Returns (num_accepted [R], output_tokens [R, G+1]).
    """
    best = target_scores.argmax(dim=-1)  # [R, G+1]
    width = draft_tokens.shape[1]
    t = accepted_count("token", draft_tokens == best[:, :width], num_drafts)
    y = best.gather(1, t[:, None])[:, 0]
    return t, _assemble(draft_tokens, t, y)


def verify_greedy_rows(best: torch.Tensor, input_ids: torch.Tensor, num_tokens: torch.Tensor
                       ) -> torch.Tensor:
    """`verify_greedy` for a step laid out one request a row, as a verify CUDA graph holds it:
    best [R, Q] the argmax of each query row's logits, input_ids [R, Q] the request's step
    tokens (its last known token, then its drafts), num_tokens [R] how many of its Q rows are
    real (1 + its drafts). Returns [R, 1 + Q]: the accepted count t, then `best` (the request
    emits best[:t + 1]; the entries after those are not to be read). Only tensor operations
    of fixed shapes: a graph can hold it."""
    passed = input_ids[:, 1:] == best[:, :-1]
    t = accepted_count("token", passed, num_tokens - 1)
    return torch.cat([t[:, None], best], dim=1)


def verification_law(method: Method, target_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, draft_probs: torch.Tensor | None = None
                     ) -> VerificationLaw:
    """The law of one verification step for fixed drafts, from the code the samplers run.

    Test i passes with probability `accept_probs[:, i]` independently of the others;
    `accepted_count(method, passed, num_drafts)` turns the outcomes into t, and the final token
    then follows `final_probs[:, t]`.
    """
    d = _prepare(target_probs, draft_tokens, num_drafts, draft_probs)
    accept, weights = _acceptance(method, d)
    num_rows, width = d.tokens.shape
    finals = []
    for j in range(width + 1):
        t = torch.full((num_rows,), j, dtype=torch.long, device=d.num.device)
        dist = _final_distribution(d, t, weights)
        finals.append(dist / dist.sum(dim=-1, keepdim=True))
    final = torch.stack(finals, dim=1)
    reachable = _valid_positions(d.num + 1, width + 1)  # j <= g_r
    return VerificationLaw(accept, torch.where(reachable[..., None], final, 0.0))

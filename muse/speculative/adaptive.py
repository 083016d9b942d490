"""Adaptive verification (`enable_adaptive_verification`): how many drafts each step verifies.

Verifying the first k drafts of request r is expected to emit `1 + sum_{j<=k} S_{r,j}` tokens,
where the survival `S_{r,j} = prod_{i<=j} c_{r,i}` is the chance that drafts 1..j are all
accepted and `c_{r,i}` the chance that draft i is accepted given that its prefix was. A step
costs `draft_cost_s + T_verify(tokens it runs)`, a curve profiled once at start-up
(`StepCostModel`): at batch 1 a few more tokens are nearly free, at high batch they are not.
`choose_draft_lengths` picks, per request, the number of drafts that maximises the step's
expected tokens per second.

Where the confidences c come from:
- a drafter with a confidence head: its `DraftProposal.confidence`;
- a drafter without one: its own probability of each drafted token, q_k(x_k)
  (`draft_confidence`);
- model-free drafts (n-gram, suffix): a running acceptance rate per draft position
  (`AcceptanceTracker`, fed by the verification outcomes of earlier steps).

Lossless: every input is known before the target runs (the drafter's outputs, statistics of
past steps), never the target's output for this step. Trimming a draft is therefore the same
as having proposed a shorter one, and verification of any draft keeps the target's law.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Objective values within this relative margin count as equal (ties go to fewer drafts).
_TIE_RELATIVE = 1e-12
# A step never costs less than this in the objective (guards a zero-cost curve).
_MIN_STEP_S = 1e-12


# ---- confidences and survivals ----------------------------------------------------------------

def survival(confidence: Sequence[float] | torch.Tensor) -> list[float]:
    """S_k = prod_{j<=k} c_j for the conditional acceptance chances c [G] of one request's
    drafts. Each c is clamped to [0, 1], so S is non-increasing and within [0, 1]."""
    if isinstance(confidence, torch.Tensor):
        if confidence.dim() != 1:
            raise ValueError(f"survival takes one request's confidences [G], got shape "
                             f"{tuple(confidence.shape)}")
        confidence = confidence.detach().double().cpu().tolist()
    out, running = [], 1.0
    for value in confidence:
        value = float(value)
        if math.isnan(value):
            raise ValueError("a draft confidence is NaN")
        running *= min(max(value, 0.0), 1.0)
        out.append(running)
    return out


def survivals(confidence: Sequence[Sequence[float]] | torch.Tensor,
              lengths: Sequence[int] | None = None) -> list[list[float]]:
    """`survival` of each row of confidence [R, G] (one read-back for a tensor), cut to
    `lengths[r]` drafts when given (the drafts request r actually proposed)."""
    rows = (confidence.detach().double().cpu().tolist()
            if isinstance(confidence, torch.Tensor) else [list(row) for row in confidence])
    if lengths is not None:
        if len(lengths) != len(rows):
            raise ValueError(f"{len(lengths)} lengths for {len(rows)} rows of confidences")
        rows = [row[:length] for row, length in zip(rows, lengths)]
    return [survival(row) for row in rows]


def draft_confidence(proposal_probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """q_k(x_k): the drafter's own probability of each drafted token, from proposal probs
    q [R, G, V] and draft tokens [R, G]; returns [R, G] (float32).

    Meaningful for sampled drafts. Greedy drafts carry a one-hot q, which gives 1 everywhere;
    use the drafter's temperature-1 probabilities there, or an `AcceptanceTracker`."""
    if proposal_probs.dim() != 3 or tokens.shape != proposal_probs.shape[:2]:
        raise ValueError(f"probs must be [R, G, V] and tokens [R, G]; got "
                         f"{tuple(proposal_probs.shape)} and {tuple(tokens.shape)}")
    index = tokens.to(device=proposal_probs.device, dtype=torch.long).unsqueeze(-1)
    return proposal_probs.gather(-1, index).squeeze(-1).float()


class AcceptanceTracker:
    """Per draft position, an exponential moving average of the chance that the draft there is
    accepted given that every draft before it was: the confidences of model-free drafts.

    `record(num_drafted, num_accepted)` takes one request's verification outcome: positions
    before `num_accepted` were accepted, the position at `num_accepted` (if drafted) was
    rejected, and later positions were never tested (their prefix failed), so they are left
    alone. Positions never observed keep the prior.
    """

    def __init__(self, num_positions: int = 0, prior: float = 0.5, alpha: float = 0.05) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior must be in [0, 1], got {prior}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.prior = prior
        self.alpha = alpha
        self.rates: list[float] = [prior] * num_positions
        self.counts: list[int] = [0] * num_positions  # outcomes seen per position

    def _grow(self, num_positions: int) -> None:
        extra = num_positions - len(self.rates)
        if extra > 0:
            self.rates.extend([self.prior] * extra)
            self.counts.extend([0] * extra)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_drafted:
            raise ValueError(f"accepted {num_accepted} of {num_drafted} drafts")
        tested = min(num_accepted + 1, num_drafted)
        self._grow(tested)
        for position in range(tested):
            outcome = 1.0 if position < num_accepted else 0.0
            self.rates[position] += self.alpha * (outcome - self.rates[position])
            self.counts[position] += 1

    def confidence(self, num_drafts: int) -> list[float]:
        """c_1..c_n for a draft of `num_drafts` tokens."""
        self._grow(num_drafts)
        return self.rates[:num_drafts]

    def survival(self, num_drafts: int) -> list[float]:
        return survival(self.confidence(num_drafts))


# ---- the cost of a step -----------------------------------------------------------------------

def measure_seconds(run: Callable[[], None], repeats: int,
                    timer: Callable[[], float] = time.perf_counter,
                    synchronize: Callable[[], None] | None = None, warmup: int = 1) -> float:
    """Median wall time of `run()` over `repeats` calls, after `warmup` untimed calls.
    `synchronize` (e.g. `torch.cuda.synchronize`) runs before each start and stop reading, so
    queued device work is counted in the call that queued it."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        if synchronize is not None:
            synchronize()
        start = timer()
        run()
        if synchronize is not None:
            synchronize()
        samples.append(timer() - start)
    return float(statistics.median(samples))


class StepCostModel:
    """T_verify(n): the time of a target step running n tokens, interpolated linearly between
    profiled points, held at the first point's time below it, and extended past the last point
    along the last segment's slope (through the origin when there is one point). Plus a
    constant drafter cost per step, `draft_cost_s`.

    The curve is made non-decreasing: points are sorted by token count and each time is raised
    to the largest time before it (a running maximum), so a noisy measurement that dips below
    its predecessor takes the predecessor's value. The raw times stay in `measured_s`.
    """

    def __init__(self, token_counts: Sequence[int], times_s: Sequence[float],
                 draft_cost_s: float = 0.0) -> None:
        if len(token_counts) == 0 or len(token_counts) != len(times_s):
            raise ValueError(f"need as many times as token counts (at least one), got "
                             f"{len(token_counts)} counts and {len(times_s)} times")
        points = sorted(zip((int(n) for n in token_counts), (float(t) for t in times_s)))
        counts = [n for n, _ in points]
        if counts[0] < 0 or len(set(counts)) != len(counts):
            raise ValueError(f"token counts must be distinct and >= 0, got {list(token_counts)}")
        measured = [t for _, t in points]
        if any(not math.isfinite(t) or t < 0 for t in measured):
            raise ValueError(f"step times must be finite and >= 0, got {list(times_s)}")
        if not math.isfinite(draft_cost_s) or draft_cost_s < 0:
            raise ValueError(f"draft_cost_s must be finite and >= 0, got {draft_cost_s}")
        times, highest = [], 0.0
        for t in measured:
            highest = max(highest, t)
            times.append(highest)
        self.token_counts: list[int] = counts
        self.measured_s: list[float] = measured
        self.times_s: list[float] = times
        self.draft_cost_s = float(draft_cost_s)

    @classmethod
    def profile(cls, run_step: Callable[[int], None], token_counts: Sequence[int],
                repeats: int = 5, timer: Callable[[], float] = time.perf_counter,
                synchronize: Callable[[], None] | None = None, *, draft_cost_s: float = 0.0,
                warmup: int = 1) -> StepCostModel:
        """Time `run_step(n)` (a dummy forward of n tokens) for each n: the median of `repeats`
        timed calls after `warmup` untimed ones (per n: each shape may compile or tune)."""
        counts = sorted({int(n) for n in token_counts})
        if not counts or counts[0] < 1:
            raise ValueError(f"profile needs token counts >= 1, got {list(token_counts)}")
        times = [measure_seconds(lambda n=n: run_step(n), repeats, timer, synchronize, warmup)
                 for n in counts]
        return cls(counts, times, draft_cost_s)

    def verify_time(self, num_tokens: float) -> float:
        """T_verify(num_tokens) in seconds."""
        counts, times = self.token_counts, self.times_s
        if num_tokens <= counts[0]:
            return times[0]
        if num_tokens >= counts[-1]:
            if len(counts) == 1:
                return times[0] * num_tokens / counts[0]  # counts[0] > 0 here
            slope = (times[-1] - times[-2]) / (counts[-1] - counts[-2])
            return times[-1] + slope * (num_tokens - counts[-1])
        right = bisect.bisect_right(counts, num_tokens)
        n0, n1, t0, t1 = counts[right - 1], counts[right], times[right - 1], times[right]
        return t0 + (t1 - t0) * (num_tokens - n0) / (n1 - n0)

    def step_time(self, num_tokens: float) -> float:
        """draft_cost_s + T_verify(num_tokens)."""
        return self.draft_cost_s + self.verify_time(num_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {"token_counts": list(self.token_counts), "times_s": list(self.times_s),
                "measured_s": list(self.measured_s), "draft_cost_s": self.draft_cost_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        """From `to_dict`'s output; the raw `measured_s` are used when present."""
        return cls(data["token_counts"], data.get("measured_s", data["times_s"]),
                   data.get("draft_cost_s", 0.0))

    def __repr__(self) -> str:
        points = ", ".join(f"{n}:{t * 1e3:.3f}ms" for n, t in zip(self.token_counts,
                                                                   self.times_s))
        return f"StepCostModel([{points}], draft_cost_s={self.draft_cost_s:.6f})"


# ---- the choice -------------------------------------------------------------------------------

def expected_rate(survivals: Sequence[Sequence[float]], lengths: Sequence[int],
                  base_tokens: int, cost: StepCostModel,
                  base_emitted: float | None = None) -> float:
    """Expected tokens per second of a step verifying the first `lengths[r]` drafts of each
    request: (base_emitted + sum_r sum_{j<=k_r} S_{r,j}) / (draft_cost + T_verify(base_tokens
    + sum_r k_r)). `base_emitted` defaults to one token per request in `survivals`."""
    emitted = float(len(survivals) if base_emitted is None else base_emitted)
    emitted += sum(sum(row[:k]) for row, k in zip(survivals, lengths))
    return emitted / max(cost.step_time(base_tokens + sum(lengths)), _MIN_STEP_S)


def choose_draft_lengths(survivals: Sequence[Sequence[float]], base_tokens: int,
                         cost: StepCostModel, base_emitted: float | None = None) -> list[int]:
    """How many drafts k_r of each request to verify this step, to maximise
    `expected_rate` (expected tokens per second).

    survivals[r][j]: the chance that drafts 1..j+1 of request r are all accepted; a request
    verifies a prefix of its drafts (draft j needs drafts before it). base_tokens: the tokens
    the step runs anyway (one per decoding request, plus prefill chunks). base_emitted: the
    tokens the step emits anyway, by default one per request in `survivals` (pass the number
    of all decoding requests when some have no drafts).

    For a fixed total K, the best numerator takes the K largest survivals; because survivals
    do not increase along a request, those form a prefix-closed choice. So the slots are taken
    in decreasing survival across requests (ties: earlier position, then earlier request) and
    every prefix of that order is scored: O(N log N) for N drafts. Ties in the objective go to
    fewer drafts. A survival larger than the one before it in its request is lowered to it
    (its true value cannot be larger), and survivals are clamped to [0, 1].

    Lossless: the choice uses only draft-side information (the drafter's confidences or
    probabilities, statistics of earlier steps), never this step's target output, so a trimmed
    draft is just a shorter draft and verification keeps the target's distribution.
    """
    slots: list[tuple[float, int, int]] = []
    for r, row in enumerate(survivals):
        previous = 1.0
        for j, value in enumerate(row):
            value = float(value)
            if math.isnan(value):
                raise ValueError(f"survival {j} of request {r} is NaN")
            previous = min(max(value, 0.0), previous)
            slots.append((-previous, j, r))
    slots.sort()
    emitted = float(len(survivals) if base_emitted is None else base_emitted)
    best_value = emitted / max(cost.step_time(base_tokens), _MIN_STEP_S)
    best_count = 0
    for count, (negative, _, _) in enumerate(slots, start=1):
        emitted -= negative
        value = emitted / max(cost.step_time(base_tokens + count), _MIN_STEP_S)
        if value > best_value * (1.0 + _TIE_RELATIVE):
            best_value, best_count = value, count
    lengths = [0] * len(survivals)
    for _, _, r in slots[:best_count]:
        lengths[r] += 1
    return lengths

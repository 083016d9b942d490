"""Adaptive verification (`enable_adaptive_verification`): how many drafts each step verifies.

Verifying the first k drafts of request r is expected to emit `1 + sum_{j<=k} S_{r,j}` tokens,
where the survival `S_{r,j} = prod_{i<=j} c_{r,i}` is the chance that drafts 1..j are all
accepted and `c_{r,i}` the chance that draft i is accepted given that its prefix was. A step's
cost depends on its batch size and on its query length q (1 + the most drafts a request
verifies): the verify CUDA graphs pad every request to q tokens. `StepCosts` holds those times
and the drafter's, profiled once at start-up; `choose_query_len` picks the q that maximises the
step's expected tokens per second, and `worth_drafting` whether to run the drafter at all.

Where the confidences c come from:
- a drafter with a confidence head: its `DraftProposal.confidence`;
- a drafter without one: its own probability of each drafted token, q_k(x_k)
  (`draft_confidence`);
- model-free drafts (n-gram, suffix) and the decision to draft: a running acceptance rate per
  draft position (`AcceptanceTracker`, fed by the verification outcomes of earlier steps).

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


class StepCosts:
    """The time of a step by its batch size R, for each query length q it can have: 1 (plain
    decoding) and the verify shapes 1 + k the engine runs (its verify CUDA graphs pad every
    request to one of them), plus the drafter's time for R requests. Profiled once at
    start-up; between profiled batch sizes times are interpolated linearly, held at the first
    below it and extended along the last segment past the end. Times are made non-decreasing
    in R and in q (running maxima): a noisy dip takes its predecessor's value, and a longer
    shape never looks cheaper than a shorter one (the engine runs the shortest that fits).
    """

    def __init__(self, batch_sizes: Sequence[int], step_s: dict[int, Sequence[float]],
                 draft_s: Sequence[float] | None = None) -> None:
        sizes = [int(b) for b in batch_sizes]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"batch sizes must increase from >= 1, got {list(batch_sizes)}")
        if 1 not in step_s:
            raise ValueError("the costs need query length 1 (a plain decode step)")
        curves = dict(step_s)
        curves[0] = draft_s if draft_s is not None else [0.0] * len(sizes)  # the drafter
        self.batch_sizes = sizes
        self.curves: dict[int, list[float]] = {}
        for query_len, times in curves.items():
            times = [float(t) for t in times]
            if len(times) != len(sizes) or any(not math.isfinite(t) or t < 0 for t in times):
                raise ValueError(f"query length {query_len}: need {len(sizes)} finite times "
                                 f">= 0, got {times}")
            self.curves[query_len] = [max(times[:i + 1]) for i in range(len(times))]
        for shorter, longer in zip(self.query_lens, self.query_lens[1:]):
            self.curves[longer] = [max(a, b) for a, b in zip(self.curves[shorter],
                                                            self.curves[longer])]

    @property
    def query_lens(self) -> list[int]:
        return sorted(q for q in self.curves if q > 0)

    @classmethod
    def profile(cls, run_step: Callable[[int, int], None], batch_sizes: Sequence[int],
                query_lens: Sequence[int], run_draft: Callable[[int], None] | None = None,
                repeats: int = 3, synchronize: Callable[[], None] | None = None,
                warmup: int = 1, timer: Callable[[], float] = time.perf_counter) -> StepCosts:
        """Time `run_step(R, q)` (a dummy step of R requests of q tokens) and `run_draft(R)`
        for every R and q: medians of `repeats` runs after `warmup` untimed ones."""
        def timed(run: Callable[[], None]) -> float:
            return measure_seconds(run, repeats, timer, synchronize, warmup)

        steps = {q: [timed(lambda: run_step(r, q)) for r in batch_sizes] for q in query_lens}
        drafts = [timed(lambda: run_draft(r)) for r in batch_sizes] \
            if run_draft is not None else None
        return cls(batch_sizes, steps, drafts)

    def _at(self, curve: list[float], batch: float) -> float:
        sizes = self.batch_sizes
        if batch <= sizes[0]:
            return curve[0]
        if batch >= sizes[-1]:
            if len(sizes) == 1:
                return curve[0] * batch / sizes[0]
            slope = (curve[-1] - curve[-2]) / (sizes[-1] - sizes[-2])
            return curve[-1] + slope * (batch - sizes[-1])
        right = bisect.bisect_right(sizes, batch)
        b0, b1, t0, t1 = sizes[right - 1], sizes[right], curve[right - 1], curve[right]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)

    def step_time(self, query_len: int, batch: float) -> float:
        """A step of `batch` requests whose longest brings `query_len` tokens: the cost of
        the smallest profiled query length that holds it."""
        fitting = [q for q in self.query_lens if q >= query_len]
        return self._at(self.curves[fitting[0] if fitting else self.query_lens[-1]], batch)

    def draft_time(self, batch: float) -> float:
        return self._at(self.curves[0], batch)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes),
                "step_s": {q: list(self.curves[q]) for q in self.query_lens},
                "draft_s": list(self.curves[0])}

    def __repr__(self) -> str:
        rows = "; ".join(f"q={q}: " + ", ".join(f"{b}:{t * 1e3:.3f}ms" for b, t in
                                                  zip(self.batch_sizes, self.curves[q]))
                         for q in [0] + self.query_lens)
        return f"StepCosts({rows}; q=0 is the drafter)"


# ---- the choice -------------------------------------------------------------------------------

def _clean(row: Sequence[float]) -> list[float]:
    """A request's survivals clamped to [0, 1] and made non-increasing (draft j needs the
    drafts before it, so its survival cannot exceed theirs)."""
    out, previous = [], 1.0
    for j, value in enumerate(row):
        value = float(value)
        if math.isnan(value):
            raise ValueError(f"survival {j} is NaN")
        previous = min(max(value, 0.0), previous)
        out.append(previous)
    return out


def expected_rate(survivals: Sequence[Sequence[float]], query_len: int, num_requests: int,
                  costs: StepCosts, draft: bool = False) -> float:
    """Expected tokens per second of a step of `num_requests` requests in which request r
    (of those with drafts, `survivals[r]`) verifies its first min(g_r, q - 1) drafts: each
    request emits one token plus the survivals of the drafts it verifies. `draft` adds the
    drafter's time to the step's."""
    verified = query_len - 1
    emitted = num_requests + sum(sum(_clean(row)[:verified]) for row in survivals)
    seconds = costs.step_time(query_len, num_requests) \
        + (costs.draft_time(num_requests) if draft else 0.0)
    return emitted / max(seconds, _MIN_STEP_S)


def choose_query_len(survivals: Sequence[Sequence[float]], num_requests: int,
                     costs: StepCosts) -> int:
    """The query length q of the step (1: verify no draft) that maximises `expected_rate`;
    ties go to the shorter. Every request then verifies its first min(g_r, q - 1) drafts: a
    verify shape pads every request to q tokens, so a shorter prefix would save nothing.

    Lossless: the choice uses only draft-side information (the drafter's confidences or
    probabilities, statistics of earlier steps), never this step's target output, so a trimmed
    draft is just a shorter draft and verification keeps the target's distribution.
    """
    longest = max((len(row) for row in survivals), default=0)
    best, best_value = 1, expected_rate(survivals, 1, num_requests, costs)
    for query_len in costs.query_lens[1:]:
        value = expected_rate(survivals, query_len, num_requests, costs)
        if value > best_value * (1.0 + _TIE_RELATIVE):
            best, best_value = query_len, value
    # A shape longer than every draft verifies them all; the step needs only their length.
    return min(best, longest + 1)


def worth_drafting(tracker_survival: Sequence[float], num_requests: int,
                   costs: StepCosts) -> bool:
    """Whether drafting for `num_requests` requests is expected to beat plain decoding, with
    every request's survivals taken from the acceptance seen so far, the drafter's time
    included."""
    rows = [list(tracker_survival)] * num_requests
    plain = expected_rate([], 1, num_requests, costs)
    return any(expected_rate(rows, q, num_requests, costs, draft=True) > plain
               for q in costs.query_lens if q > 1)

"""Adaptive verification: survivals, confidences, the step-cost curve, and the choice of how
many drafts each request verifies (checked against exhaustive search on small instances)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from muse.speculative.adaptive import (AcceptanceTracker, StepCostModel, choose_draft_lengths,
                                       draft_confidence, expected_rate, measure_seconds,
                                       survival, survivals)


# ---- survivals and confidences ----------------------------------------------------------------

def test_survival_is_the_running_product() -> None:
    assert survival([0.9, 0.5, 1.0, 0.2]) == pytest.approx([0.9, 0.45, 0.45, 0.09])
    assert survival(torch.tensor([0.5, 0.5, 0.5])) == pytest.approx([0.5, 0.25, 0.125])
    assert survival([]) == []
    # Out-of-range confidences are clamped: survivals stay in [0, 1] and never increase.
    assert survival([1.5, -0.1, 0.7]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        survival([0.5, float("nan")])
    with pytest.raises(ValueError):
        survival(torch.ones(2, 3))


def test_survivals_of_rows_cut_to_lengths() -> None:
    confidence = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.8, 0.5]])
    assert survivals(confidence, [2, 3]) == [pytest.approx([0.5, 0.25]),
                                             pytest.approx([1.0, 0.8, 0.4])]
    assert survivals([[0.5], [0.25, 1.0]]) == [[0.5], [0.25, 0.25]]


def test_draft_confidence_gathers_the_probability_of_each_drafted_token() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 4, 6, generator=generator).softmax(-1)
    tokens = torch.randint(0, 6, (3, 4), generator=generator)
    got = draft_confidence(probs, tokens)
    assert got.shape == (3, 4) and got.dtype == torch.float32
    for r in range(3):
        for k in range(4):
            assert got[r, k].item() == pytest.approx(probs[r, k, tokens[r, k]].item())
    # One-hot q (greedy drafts) gives 1: no information, as documented.
    one_hot = torch.nn.functional.one_hot(tokens, 6).float()
    assert torch.equal(draft_confidence(one_hot, tokens), torch.ones(3, 4))
    with pytest.raises(ValueError):
        draft_confidence(probs, tokens[:, :2])


def test_acceptance_tracker_converges_to_the_conditional_rates() -> None:
    # Each draft is accepted (given its prefix) with chance 0.8 at position 0, 0.5 at 1, 0.3
    # at 2; the tracker sees only (drafted, accepted) and must recover those rates.
    truth = [0.8, 0.5, 0.3]
    tracker = AcceptanceTracker(num_positions=3, prior=0.5, alpha=0.01)
    assert tracker.confidence(3) == [0.5, 0.5, 0.5]
    rng = random.Random(1)
    for _ in range(20000):
        accepted = 0
        while accepted < 3 and rng.random() < truth[accepted]:
            accepted += 1
        tracker.record(3, accepted)
    assert tracker.confidence(3) == pytest.approx(truth, abs=0.06)
    assert tracker.survival(2) == pytest.approx([truth[0], truth[0] * truth[1]], abs=0.06)


def test_acceptance_tracker_updates_only_tested_positions() -> None:
    tracker = AcceptanceTracker(prior=0.5, alpha=0.5)
    tracker.record(4, 1)  # position 0 accepted, 1 rejected, 2 and 3 never tested
    assert tracker.confidence(4) == [0.75, 0.25, 0.5, 0.5]
    assert tracker.counts == [1, 1, 0, 0]
    tracker.record(2, 2)  # all drafted accepted: nothing rejected
    assert tracker.confidence(2) == [0.875, 0.625]
    tracker.record(0, 0)
    assert tracker.counts == [2, 2, 0, 0]
    with pytest.raises(ValueError):
        tracker.record(2, 3)


# ---- the step-cost curve ----------------------------------------------------------------------

class FakeClock:
    """A timer that advances only when a fake step runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_profile_gives_the_piecewise_linear_curve() -> None:
    clock, calls, syncs = FakeClock(), [], []
    true_time = {1: 1.0, 4: 1.3, 16: 2.5, 64: 7.3}
    noise = itertools.cycle([0.0, 0.5, -0.01, 0.0, 9.0])  # the median ignores the outliers

    def run_step(n: int) -> None:
        warm = any(c == n for c in calls)
        calls.append(n)
        clock.now += true_time[n] + (next(noise) if warm else 100.0)  # slow first call

    cost = StepCostModel.profile(run_step, [16, 1, 64, 4, 4], repeats=5, timer=clock,
                                 synchronize=lambda: syncs.append(1), draft_cost_s=0.25)
    assert cost.token_counts == [1, 4, 16, 64]
    assert cost.times_s == pytest.approx([1.0, 1.3, 2.5, 7.3])
    assert len(calls) == 4 * 6 and len(syncs) == 4 * 5 * 2  # one warm-up + 5 timed per n
    assert cost.draft_cost_s == 0.25
    # Between points: linear interpolation.
    assert cost.verify_time(10) == pytest.approx(1.3 + (2.5 - 1.3) * 6 / 12)
    assert cost.verify_time(40) == pytest.approx(2.5 + (7.3 - 2.5) * 0.5)
    assert cost.step_time(4) == pytest.approx(1.55)
    # Below the first point: held. Past the last: the last segment's slope (0.1 / token).
    assert cost.verify_time(0) == pytest.approx(1.0)
    assert cost.verify_time(128) == pytest.approx(7.3 + 0.1 * 64)
    assert cost.verify_time(1000) == pytest.approx(7.3 + 0.1 * 936)


def test_cost_curve_is_made_monotone() -> None:
    clock = FakeClock()
    measured = {1: 1.0, 2: 2.0, 4: 1.5, 8: 1.8, 16: 3.0}  # 4 and 8 dip below 2's time

    def run_step(n: int) -> None:
        clock.now += measured[n]

    cost = StepCostModel.profile(run_step, list(measured), repeats=3, timer=clock)
    # Each time is raised to the running maximum of those before it.
    assert cost.times_s == pytest.approx([1.0, 2.0, 2.0, 2.0, 3.0])
    assert cost.measured_s == pytest.approx([1.0, 2.0, 1.5, 1.8, 3.0])
    grid = [x / 4 for x in range(0, 4 * 40)]
    values = [cost.verify_time(x) for x in grid]
    assert all(b >= a for a, b in zip(values, values[1:]))
    assert cost.verify_time(6) == pytest.approx(2.0)
    # Extrapolation uses the corrected last segment: (3 - 2) / 8 per token.
    assert cost.verify_time(24) == pytest.approx(4.0)


def test_cost_model_round_trips_and_validates() -> None:
    cost = StepCostModel([8, 1, 2], [3.0, 1.0, 0.5], draft_cost_s=0.1)
    assert cost.times_s == [1.0, 1.0, 3.0]
    again = StepCostModel.from_dict(cost.to_dict())
    assert again.to_dict() == cost.to_dict()
    for n in (0, 1, 1.5, 5, 8, 20):
        assert again.step_time(n) == cost.step_time(n)
    # One point: proportional past it, held below it.
    single = StepCostModel([4], [2.0])
    assert single.verify_time(2) == 2.0 and single.verify_time(8) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        StepCostModel([], [])
    with pytest.raises(ValueError):
        StepCostModel([1, 1], [1.0, 2.0])
    with pytest.raises(ValueError):
        StepCostModel([1, 2], [1.0, -2.0])
    with pytest.raises(ValueError):
        StepCostModel.profile(lambda n: None, [0, 4], repeats=1)


def test_measure_seconds_is_a_median_after_warmup() -> None:
    clock, durations = FakeClock(), iter([50.0, 1.0, 3.0, 2.0])

    def run() -> None:
        clock.now += next(durations)

    assert measure_seconds(run, repeats=3, timer=clock) == 2.0
    with pytest.raises(ValueError):
        measure_seconds(run, repeats=0, timer=clock)


# ---- the choice -------------------------------------------------------------------------------

SURVIVALS = [[0.9, 0.7, 0.4, 0.1], [0.6, 0.3], [0.95, 0.9, 0.85, 0.8, 0.75]]


def test_free_verification_verifies_everything() -> None:
    flat = StepCostModel([1, 4096], [0.01, 0.01], draft_cost_s=0.002)
    assert choose_draft_lengths(SURVIVALS, base_tokens=3, cost=flat) == [4, 2, 5]
    # A draft that is sure to fail adds nothing: the tie goes to fewer drafts.
    assert choose_draft_lengths([[0.5, 0.0, 0.0], [1.0]], 2, flat) == [1, 1]


def test_steep_cost_verifies_nothing_or_the_likeliest() -> None:
    # Each token costs as much as the whole base step: no draft pays for itself.
    steep = StepCostModel([1, 2], [1.0, 2.0])
    assert choose_draft_lengths(SURVIVALS, base_tokens=3, cost=steep) == [0, 0, 0]
    # Base step 1.0 s for 3 tokens, then 0.3 s per token: a draft pays if S > rate * 0.3.
    moderate = StepCostModel([3, 4], [1.0, 1.3])
    lengths = choose_draft_lengths(SURVIVALS, base_tokens=3, cost=moderate)
    chosen = sorted((s for row, k in zip(SURVIVALS, lengths) for s in row[:k]), reverse=True)
    others = [s for row, k in zip(SURVIVALS, lengths) for s in row[k:]]
    assert 0 < len(chosen) < sum(map(len, SURVIVALS))
    assert min(chosen) >= max(others)  # only the likeliest drafts
    best = max(expected_rate(SURVIVALS, list(ks), 3, moderate)
               for ks in itertools.product(*(range(len(row) + 1) for row in SURVIVALS)))
    assert expected_rate(SURVIVALS, lengths, 3, moderate) == pytest.approx(best, rel=1e-12)


def _random_instance(rng: random.Random) -> tuple[list[list[float]], int, StepCostModel]:
    rows = []
    for _ in range(rng.randint(2, 3)):
        row, running = [], 1.0
        for _ in range(rng.randint(0, 4)):
            # Coarse values now and then, so that equal survivals (ties) occur.
            c = rng.choice([rng.random(), rng.choice([0.0, 0.5, 1.0])])
            running *= c
            row.append(running)
        rows.append(row)
    counts = sorted(rng.sample(range(1, 20), rng.randint(1, 5)))
    times, t = [], rng.uniform(0.0, 1.0)
    for _ in counts:
        t += rng.choice([0.0, rng.uniform(0.0, 0.5), rng.uniform(0.0, 3.0)])
        times.append(t)
    return rows, rng.randint(0, 4), StepCostModel(counts, times, rng.uniform(0.0, 0.5))


def test_greedy_prefix_matches_exhaustive_search() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        rows, base, cost = _random_instance(rng)
        got = choose_draft_lengths(rows, base, cost)
        assert all(0 <= k <= len(row) for k, row in zip(got, rows))
        best = max(expected_rate(rows, list(ks), base, cost)
                   for ks in itertools.product(*(range(len(row) + 1) for row in rows)))
        assert math.isclose(expected_rate(rows, got, base, cost), best, rel_tol=1e-9,
                            abs_tol=1e-9), (rows, base, cost, got)


def test_choice_is_prefix_closed_per_request() -> None:
    # Request 1's second draft is likelier than request 0's first, but request 1's first is
    # not: the choice never verifies a draft without the drafts before it.
    rows = [[0.5], [0.4, 0.4, 0.1]]
    cost = StepCostModel([2, 3, 4, 5], [1.0, 1.0, 1.0, 10.0])
    assert choose_draft_lengths(rows, 2, cost) == [1, 1]
    cost = StepCostModel([2, 4, 5], [1.0, 1.0, 10.0])
    assert choose_draft_lengths(rows, 2, cost) == [1, 1]  # two slots: 0.5 and request 1's first
    # An inconsistent survival above its predecessor is lowered to it: still a prefix.
    rows = [[0.2, 0.9, 0.9], [0.3]]
    lengths = choose_draft_lengths(rows, 2, StepCostModel([2, 4, 6], [1.0, 1.0, 50.0]))
    assert lengths == [1, 1]
    assert choose_draft_lengths([], 0, cost) == []
    assert choose_draft_lengths([[], []], 2, cost) == [0, 0]


def test_base_emitted_counts_requests_without_drafts() -> None:
    # Many requests decode without drafts: their tokens make each extra token cost more in
    # rate, so fewer drafts are worth verifying.
    rows = [[0.45, 0.3]]  # alone both pay; with 20 tokens at stake a draft needs S > 0.51
    cost = StepCostModel([1, 100], [1.0, 1.0 + 99 * 0.05])
    assert choose_draft_lengths(rows, 1, cost) == [2]
    assert choose_draft_lengths(rows, 20, cost, base_emitted=20) == [0]

"""Adaptive verification: survivals, confidences, the step costs, the choice of the step's
verify shape (checked against every shape on random instances) and of drafting at all."""

from __future__ import annotations

import math
import random

import pytest
import torch

from muse.speculative.adaptive import (AcceptanceTracker, StepCosts, choose_query_len,
                                       draft_confidence, expected_rate, measure_seconds,
                                       survival, survivals, worth_drafting)


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


def test_profile_times_every_shape_and_the_drafter() -> None:
    clock, syncs = FakeClock(), []
    step_time = {(1, 1): 1.0, (4, 1): 1.2, (1, 8): 2.0, (4, 8): 3.5}
    calls = []

    def run_step(requests: int, query_len: int) -> None:
        warm = (requests, query_len) in calls
        calls.append((requests, query_len))
        clock.now += step_time[requests, query_len] + (0.0 if warm else 100.0)

    def run_draft(requests: int) -> None:
        clock.now += 0.5 * requests

    costs = StepCosts.profile(run_step, [1, 4], [1, 8], run_draft, repeats=3,
                              synchronize=lambda: syncs.append(1), warmup=1, timer=clock)
    assert costs.query_lens == [1, 8] and costs.batch_sizes == [1, 4]
    assert costs.step_time(1, 1) == pytest.approx(1.0)
    assert costs.step_time(8, 4) == pytest.approx(3.5)
    assert costs.draft_time(4) == pytest.approx(2.0)
    assert len(calls) == 4 * 4 and len(syncs) == (4 + 2) * 3 * 2  # warm-up + 3 timed each
    # Between batch sizes: linear; below the first: held; past the last: the last slope.
    assert costs.step_time(8, 2) == pytest.approx(2.5)
    assert costs.step_time(8, 0.5) == pytest.approx(2.0)
    assert costs.step_time(1, 10) == pytest.approx(1.2 + 0.2 / 3 * 6)
    # A query length between profiled ones costs as the next longer one.
    assert costs.step_time(3, 1) == costs.step_time(8, 1)


def test_step_costs_are_made_monotone_and_validated() -> None:
    costs = StepCosts([1, 2, 4, 8], {1: [1.0, 2.0, 1.5, 3.0], 4: [2.0, 2.0, 2.0, 2.0]})
    # Each curve is raised to its running maximum over batch sizes, then to the shorter
    # shape's times; no drafter means a free drafter.
    assert costs.to_dict()["step_s"][1] == [1.0, 2.0, 2.0, 3.0]
    assert costs.to_dict()["step_s"][4] == [2.0, 2.0, 2.0, 3.0]
    assert costs.draft_time(3) == 0.0
    assert "q=4" in repr(costs)
    with pytest.raises(ValueError, match="increase"):
        StepCosts([2, 1], {1: [1.0, 1.0]})
    with pytest.raises(ValueError, match="query length 1"):
        StepCosts([1], {4: [1.0]})
    with pytest.raises(ValueError, match="finite"):
        StepCosts([1, 2], {1: [1.0, -1.0]})


def test_measure_seconds_is_a_median_after_warmup() -> None:
    clock, durations = FakeClock(), iter([50.0, 1.0, 3.0, 2.0])

    def run() -> None:
        clock.now += next(durations)

    assert measure_seconds(run, repeats=3, timer=clock) == 2.0
    with pytest.raises(ValueError):
        measure_seconds(run, repeats=0, timer=clock)


# ---- the choice -------------------------------------------------------------------------------

SURVIVALS = [[0.9, 0.7, 0.4, 0.1], [0.6, 0.3], [0.95, 0.9, 0.85, 0.8, 0.75]]


def costs_of(decode: float, verify: dict[int, float], draft: float = 0.0) -> StepCosts:
    """Costs that do not depend on the batch size."""
    return StepCosts([1, 64], {1: [decode] * 2} | {q: [t] * 2 for q, t in verify.items()},
                     [draft] * 2)


def test_free_verification_verifies_every_draft() -> None:
    flat = costs_of(1.0, {2: 1.0, 4: 1.0, 8: 1.0})
    assert choose_query_len(SURVIVALS, 3, flat) == 6  # the longest request's 5 drafts + 1
    assert choose_query_len([[0.5, 0.2]], 1, flat) == 3


def test_steep_verification_verifies_nothing() -> None:
    steep = costs_of(1.0, {2: 10.0, 4: 20.0, 8: 40.0})
    assert choose_query_len(SURVIVALS, 3, steep) == 1
    assert choose_query_len([], 3, steep) == 1


def test_the_chosen_shape_maximises_the_expected_rate() -> None:
    rng = random.Random(7)
    for _ in range(500):
        rows = [[rng.random() for _ in range(rng.randint(0, 7))] for _ in range(rng.randint(1, 4))]
        rows = [survival(row) for row in rows]
        requests = len(rows) + rng.randint(0, 3)
        verify = {q: rng.uniform(1.0, 4.0) for q in (2, 4, 8)}
        costs = costs_of(1.0, verify)
        chosen = choose_query_len(rows, requests, costs)
        longest = max(len(row) for row in rows)
        assert 1 <= chosen <= longest + 1
        best = max(expected_rate(rows, q, requests, costs) for q in costs.query_lens)
        assert math.isclose(expected_rate(rows, chosen, requests, costs), best, rel_tol=1e-9)


def test_an_inconsistent_survival_is_lowered_to_its_predecessor() -> None:
    flat = costs_of(1.0, {8: 1.0})
    # 0.9 after 0.2 cannot be: drafts 1..2 survive together at most as often as draft 1.
    assert expected_rate([[0.2, 0.9]], 8, 1, flat) == pytest.approx(1 + 0.2 + 0.2)


def test_drafting_is_worth_it_only_when_acceptance_pays_for_the_drafter() -> None:
    costs = costs_of(1.0, {8: 2.0}, draft=1.0)
    # With drafts: (1 + sum S) / 3 per request against 1 / 1 plain.
    assert worth_drafting(survival([0.95] * 7), 4, costs)  # 1 + 5.5 > 3
    assert not worth_drafting(survival([0.5] * 7), 4, costs)  # 1 + 1 < 3
    assert not worth_drafting(survival([0.9] * 7), 4, costs_of(1.0, {8: 2.0}, draft=9.0))

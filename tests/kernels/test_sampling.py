"""Top-k / top-p without a sort: the kept sets are those of the sort-based formulation."""

from __future__ import annotations

import itertools

import pytest
import torch

from muse.engine.sampler import RowParameters, SamplingRow
from muse.engine.sampling_params import SamplingParams
from muse.kernels.sampling import top_k_top_p_filter, top_k_top_p_filter_sort
from tests.conftest import DEVICE

TOP_KS = [0, 1, 5, 50]
TOP_PS = [1.0, 0.9, 0.5, 0.01]
INF = float("-inf")


def near_a_cumulative_sum(logits: torch.Tensor, top_k: int, top_p: float) -> bool:
    """Whether top_p lies within float32 rounding of a cumulative sum of the row's nucleus.

    There the kept set hinges on the order the probabilities are added in, which the two
    formulations do not share.
    """
    ordered = logits.double().sort(descending=True).values
    if top_k:
        ordered = ordered[:top_k]
    cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
    return top_p < 1.0 and bool(((cumulative - top_p).abs() < 1e-5).any())


def random_batch(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (top_k, top_p) pair twice, at several logit scales (flat to peaked), rows shuffled."""
    gen = torch.Generator().manual_seed(seed)
    pairs = list(itertools.product(TOP_KS, TOP_PS)) * 2
    order = torch.randperm(len(pairs), generator=gen).tolist()
    top_k = torch.tensor([pairs[i][0] for i in order])
    top_p = torch.tensor([pairs[i][1] for i in order])
    scales = torch.tensor([0.5, 2.0, 4.0, 8.0]).repeat(len(pairs) // 4)[:, None]
    # Normal quantiles in a random order: Gaussian-looking logits, all distinct by construction.
    quantiles = torch.erfinv((torch.arange(vocab) + 0.5) / vocab * 2 - 1) * 2 ** 0.5
    ranks = torch.stack([torch.randperm(vocab, generator=gen) for _ in pairs])
    logits = quantiles[ranks] * scales
    return logits.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


@pytest.mark.parametrize("vocab,seed", [(1001, 0), (1001, 1), (64, 2), (4099, 3)])
def test_kept_sets_equal_the_sorted_ones(vocab, seed):
    logits, top_k, top_p = random_batch(vocab, seed)
    for row in logits:
        assert row.unique().numel() == vocab  # no tie decides anything
    fast = top_k_top_p_filter(logits, top_k, top_p)
    slow = top_k_top_p_filter_sort(logits, top_k, top_p)
    compared = 0
    for i in range(logits.shape[0]):
        if near_a_cumulative_sum(logits[i].cpu(), int(top_k[i]), float(top_p[i])):
            continue
        compared += 1
        kept = fast[i].isfinite()
        assert torch.equal(kept, slow[i].isfinite()), (int(top_k[i]), float(top_p[i]))
        assert torch.equal(fast[i][kept], logits[i][kept])  # kept logits are untouched
        if top_k[i] > 0:
            assert int(kept.sum()) <= int(top_k[i])
    assert compared >= logits.shape[0] - 2


def test_host_hints_give_the_same_result():
    logits, top_k, top_p = random_batch(257, 4)
    plain = top_k_top_p_filter(logits, top_k, top_p)
    hinted = top_k_top_p_filter(logits, top_k, top_p, max_top_k=int(top_k.max()),
                                any_top_p=True)
    assert torch.equal(plain, hinted)


def test_rows_without_limits_are_untouched():
    """top_k 0 or >= vocab and top_p 1 leave a row as it is, even next to rows that filter."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 3000, generator=gen) * 0.1).to(DEVICE)  # flat: a long, light tail
    top_k = torch.tensor([0, 3000, 7000, 2], device=DEVICE)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5], device=DEVICE)
    for filtered in (top_k_top_p_filter(logits, top_k, top_p),
                     top_k_top_p_filter_sort(logits, top_k, top_p)):
        assert torch.equal(filtered[:3], logits[:3])
        assert int(filtered[3].isfinite().sum()) == 1  # of the top two, the first reaches 0.5


def test_equal_values_are_kept_or_dropped_together():
    # top-k = 2 with three tied leaders keeps all three; the sort keeps two of them.
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, -1.0]], device=DEVICE)
    kept = top_k_top_p_filter(logits, torch.tensor([2], device=DEVICE),
                              torch.tensor([1.0], device=DEVICE)).isfinite()[0]
    assert kept.tolist() == [False, True, False, True, True, False]
    # top-p: the leader holds ~0.53 < 0.6, so the next token is needed, and its twin comes too.
    logits = torch.tensor([[1.0, 2.0, 0.0, 1.0]], device=DEVICE)
    no_k = torch.tensor([0], device=DEVICE)
    kept = top_k_top_p_filter(logits, no_k, torch.tensor([0.6], device=DEVICE)).isfinite()[0]
    assert kept.tolist() == [True, True, False, True]
    assert int(top_k_top_p_filter_sort(logits, no_k, torch.tensor([0.6], device=DEVICE))
               .isfinite().sum()) == 2
    # Once the leader alone reaches top_p the tied pair is dropped together.
    kept = top_k_top_p_filter(logits, no_k, torch.tensor([0.5], device=DEVICE)).isfinite()[0]
    assert kept.tolist() == [False, True, False, False]


def test_row_parameters_are_packed_for_one_copy():
    rows = [SamplingRow(params, [], [], (2,), None) for params in (
        SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5),  # greedy: neutral
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=100_000, min_p=0.1),  # top_k beyond the vocab
    )]
    params = RowParameters.from_rows(rows, 1000, torch.device(DEVICE))
    assert params.greedy.tolist() == [True, False, False]
    assert params.temperature.tolist() == pytest.approx([1.0, 0.7, 1.3])
    assert params.top_k.tolist() == [0, 40, 1000] and params.top_k.dtype == torch.int64
    assert params.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert params.min_p.tolist() == pytest.approx([0.0, 0.0, 0.1])
    assert (params.max_top_k, params.any_top_p, params.any_min_p) == (40, True, True)

"""Speculative verification is lossless.

1. Exact laws on tiny vocabularies: one verification step, extended by target sampling, has the
   target's joint law, for context-dependent target and draft tables with zeros in both.
2. Monte Carlo over the whole speculative loop (several steps, ragged draft counts): total
   variation and chi-square against the exact target joint, calibrated by plain target sampling
   with the same number of samples.
3. Negative controls (block verification stopping at the first failed test; the unweighted
   residual max(p - q, 0)) that both checks must reject, so that they can fail.
4. Greedy verification against a per-request loop; ragged batches against requests run alone.
"""

from __future__ import annotations

import itertools
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chi2 as chi2_distribution

import muse.speculative.verification as verification
from muse.speculative.verification import (accepted_count, verification_law, verify_block,
                                           verify_greedy, verify_tokenwise)

VERIFIERS = {"token": verify_tokenwise, "block": verify_block}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


# --- Toy target and drafter --------------------------------------------------------------------

def _random_rows(num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """Random distributions with about 30% zeros (never a whole row)."""
    raw = torch.rand(num_rows, vocab, generator=generator, dtype=torch.float64) + 0.05
    zero = torch.rand(num_rows, vocab, generator=generator) < 0.3
    zero &= F.one_hot(raw.argmax(dim=-1), vocab) == 0
    raw = raw.masked_fill(zero, 0.0)
    return raw / raw.sum(dim=-1, keepdim=True)


class ToyModels:
    """A target p(. | prefix) and a drafter q(. | prefix) for every prefix of up to `max_len`
    tokens, as float64 tables indexed by prefix id (empty prefix 0; id(u + [x]) = id(u) V + x + 1).

    Besides independent random rows (so q often puts mass where p has none), some prefixes have
    q = p (no residual mass at all) and some a one-hot q.
    """

    def __init__(self, vocab: int, max_len: int, seed: int) -> None:
        self.vocab = vocab
        num_rows = sum(vocab ** k for k in range(max_len + 1))
        generator = torch.Generator().manual_seed(seed)
        self.p = _random_rows(num_rows, vocab, generator)
        q = _random_rows(num_rows, vocab, generator)
        rows = torch.arange(num_rows)
        same = rows % 5 == 1
        q[same] = self.p[same]
        one_hot = rows % 7 == 3
        choice = torch.randint(vocab, (int(one_hot.sum()),), generator=generator)
        q[one_hot] = F.one_hot(choice, vocab).double()
        self.q = q

    def index(self, prefix: tuple[int, ...]) -> int:
        i = 0
        for x in prefix:
            i = i * self.vocab + x + 1
        return i

    def target_prob(self, context: tuple[int, ...], tokens: tuple[int, ...]) -> float:
        prob = 1.0
        for k, x in enumerate(tokens):
            prob *= float(self.p[self.index(context + tokens[:k]), x])
        return prob

    def draft_prob(self, context: tuple[int, ...], tokens: tuple[int, ...]) -> float:
        prob = 1.0
        for k, x in enumerate(tokens):
            prob *= float(self.q[self.index(context + tokens[:k]), x])
        return prob

    def step_inputs(self, context: tuple[int, ...], drafts: list[tuple[int, ...]],
                    dtype: torch.dtype, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(target_probs [N, g+1, V], draft_tokens [N, g], draft_probs [N, g, V])."""
        g = len(drafts[0])
        p_ids = [[self.index(context + x[:i]) for i in range(g + 1)] for x in drafts]
        p_ids_t = torch.tensor(p_ids)
        target = self.p[p_ids_t].to(dtype=dtype, device=device)
        draft = self.q[p_ids_t[:, :g]].to(dtype=dtype, device=device)
        return target, torch.tensor(drafts, device=device).reshape(len(drafts), g), draft


class MismatchedModels(ToyModels):
    """Tables where the drafter is far from the target: every prefix gets its own relabelling of
    a pair (p*, q*) for which the weighted residual matters most, plus noise and zeros (about
    15% in p, 10% in q), so that the Monte Carlo check has the power to reject the controls."""

    def __init__(self, max_len: int, seed: int) -> None:
        self.vocab = vocab = 3
        num_rows = sum(vocab ** k for k in range(max_len + 1))
        generator = torch.Generator().manual_seed(seed)
        base_p = torch.tensor([0.58, 0.12, 0.30], dtype=torch.float64)
        base_q = torch.tensor([0.22, 0.77, 0.01], dtype=torch.float64)
        labels = torch.rand(num_rows, vocab, generator=generator).argsort(dim=-1)

        def rows(base: torch.Tensor, zero_prob: float) -> torch.Tensor:
            noise = torch.rand(num_rows, vocab, generator=generator, dtype=torch.float64)
            raw = base[labels] + 0.1 * noise
            zero = torch.rand(num_rows, vocab, generator=generator) < zero_prob
            zero &= F.one_hot(raw.argmax(dim=-1), vocab) == 0
            raw = raw.masked_fill(zero, 0.0)
            return raw / raw.sum(dim=-1, keepdim=True)

        self.p, self.q = rows(base_p, 0.15), rows(base_q, 0.1)


@pytest.mark.parametrize("vocab,max_len,seed", [(3, 4, 1), (3, 5, 1), (4, 5, 1), (3, 3, 2),
                                                 (4, 4, 2)])
def test_toy_tables_cover_the_edge_cases(vocab: int, max_len: int, seed: int) -> None:
    """The tables of the exact tests below hold every case the verification must handle."""
    models = ToyModels(vocab, max_len, seed)
    p, q = models.p, models.q
    assert (p == 0).any(dim=-1).float().mean() > 0.3
    assert (q == 0).any(dim=-1).float().mean() > 0.3
    assert ((q > 0) & (p == 0)).any(dim=-1).float().mean() > 0.2  # q where p has no mass
    assert (q == p).all(dim=-1).any() and (q == 1).any(dim=-1).any()


# --- Exact laws --------------------------------------------------------------------------------

def _step_law(method: str, target: torch.Tensor, drafts: torch.Tensor,
              draft_probs: torch.Tensor | None) -> torch.Tensor:
    """[N, g+1, V]: probability that the step with the drafts of row n emits x_1..x_j, y.

    Enumerates the 2^g outcomes of the tests with the module's own test probabilities and
    counting rule, so it checks the code the samplers run."""
    num, g = drafts.shape
    num_drafts = torch.full((num,), g, device=drafts.device)
    law = verification_law(method, target, drafts, num_drafts, draft_probs)
    outcomes = torch.tensor(list(itertools.product([False, True], repeat=g)),
                            device=drafts.device).reshape(2 ** g, g)
    accept = law.accept_probs.double()[:, None, :]
    outcome_prob = torch.where(outcomes[None], accept, 1 - accept).prod(dim=-1)  # [N, 2^g]
    t = accepted_count(method, outcomes[None].expand(num, -1, -1),
                       num_drafts[:, None].expand(num, 2 ** g))
    t_law = torch.zeros(num, g + 1, dtype=torch.float64, device=drafts.device)
    t_law.scatter_add_(1, t, outcome_prob)
    return t_law[..., None] * law.final_probs.double()


def _lossless_error(models: ToyModels, context: tuple[int, ...],
                    drafts: list[tuple[int, ...]], weights: list[float],
                    step: torch.Tensor) -> float:
    """Max |law - target| over sequences of g+1 tokens, where law = one step over drafts drawn
    with `weights`, continued by sampling the target."""
    g = len(drafts[0])
    emitted: dict[tuple[int, ...], float] = {}
    for x, weight, law in zip(drafts, weights, step.tolist()):
        for j in range(g + 1):
            for y, prob in enumerate(law[j]):
                key = x[:j] + (y,)
                emitted[key] = emitted.get(key, 0.0) + weight * prob
    error = 0.0
    for s in itertools.product(range(models.vocab), repeat=g + 1):
        law = sum(emitted.get(s[:k], 0.0) * models.target_prob(context + s[:k], s[k:])
                  for k in range(1, g + 2))
        error = max(error, abs(law - models.target_prob(context, s)))
    return error


def _sampled_drafts_error(method: str, vocab: int, g: int, dtype: torch.dtype,
                          device: torch.device) -> float:
    models = ToyModels(vocab, max_len=2 + g, seed=1)
    error = 0.0
    for context in [(), (1,), (2, 0)]:
        drafts = list(itertools.product(range(vocab), repeat=g))
        weights = [models.draft_prob(context, x) for x in drafts]
        drafts = [x for x, w in zip(drafts, weights) if w > 0]
        weights = [w for w in weights if w > 0]
        target, tokens, draft_probs = models.step_inputs(context, drafts, dtype, device)
        step = _step_law(method, target, tokens, draft_probs)
        error = max(error, _lossless_error(models, context, drafts, weights, step))
    return error


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("vocab,g", [(3, 2), (3, 3), (4, 3)])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_exact_law_sampled_drafts(method: str, vocab: int, g: int, dtype: torch.dtype,
                                  tolerance: float, device: torch.device) -> None:
    assert _sampled_drafts_error(method, vocab, g, dtype, device) < tolerance


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("vocab,g", [(3, 2), (4, 3)])
def test_exact_law_one_hot_drafts(method: str, vocab: int, g: int,
                                  device: torch.device) -> None:
    """Every fixed draft sequence is a deterministic drafter: each alone must be lossless,
    including drafts the target gives no mass."""
    models = ToyModels(vocab, max_len=1 + g, seed=2)
    context = (0,)
    drafts = list(itertools.product(range(vocab), repeat=g))
    target, tokens, _ = models.step_inputs(context, drafts, torch.float32, device)
    step = _step_law(method, target, tokens, None)
    for n, x in enumerate(drafts):
        assert _lossless_error(models, context, [x], [1.0], step[n:n + 1]) < 1e-6, x


def test_block_equals_tokenwise_for_one_hot_drafts(device: torch.device) -> None:
    models = ToyModels(vocab=4, max_len=4, seed=3)
    drafts = list(itertools.product(range(4), repeat=3))
    target, tokens, _ = models.step_inputs((2,), drafts, torch.float64, device)
    token_law = _step_law("token", target, tokens, None)
    block_law = _step_law("block", target, tokens, None)
    torch.testing.assert_close(block_law, token_law, rtol=0, atol=1e-12)


@pytest.mark.parametrize("method,expected", [("token", 10 / 9), ("block", 11 / 9)])
def test_paper_example(method: str, expected: float, device: torch.device) -> None:
    """Binary vocabulary, p = (1/3, 2/3) and q = (2/3, 1/3) at every position, g = 2."""
    p = torch.tensor([1 / 3, 2 / 3], device=device)
    q = torch.tensor([2 / 3, 1 / 3], device=device)
    drafts = torch.tensor(list(itertools.product(range(2), repeat=2)), device=device)
    step = _step_law(method, p.expand(4, 3, 2), drafts, q.expand(4, 2, 2))
    draft_weight = q[drafts].prod(dim=-1).double()
    t_law = step.sum(dim=-1)  # [4, g+1]
    mean_accepted = (draft_weight[:, None] * t_law * torch.arange(3, device=device)).sum()
    assert abs(float(mean_accepted) - expected) < 1e-6


# --- Negative controls -------------------------------------------------------------------------

def _early_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block verification that stops at its first failed test."""
    monkeypatch.setattr(verification, "_last_passed", verification._leading_passed)


def _unweighted_residual(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block verification correcting from max(p - q, 0) instead of max(w_t p - q, 0)."""
    block_acceptance = verification._block_acceptance

    def unweighted(d: verification._Drafts) -> tuple[torch.Tensor, torch.Tensor]:
        h, weights = block_acceptance(d)
        return h, torch.ones_like(weights)

    monkeypatch.setattr(verification, "_block_acceptance", unweighted)


CONTROLS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "early_break": _early_break, "unweighted_residual": _unweighted_residual}


@pytest.mark.parametrize("control", CONTROLS)
def test_exact_law_rejects_controls(control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    CONTROLS[control](monkeypatch)
    # The correct code is within 1e-16 here (1e-8 in float32); the unweighted residual is off by
    # about 1e-3, the early break by about 0.1.
    assert _sampled_drafts_error("block", 3, 3, torch.float64, torch.device("cpu")) > 1e-4


# --- Monte Carlo over the speculative loop -----------------------------------------------------

HORIZON = 4
MAX_DRAFTS = 3
NUM_SAMPLES = 300_000


def _speculative_loop(method: str, models: ToyModels, drafter: str, num: int,
                      generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """[num, HORIZON] tokens from `num` independent requests, each verified step by step with a
    random draft count in 0..MAX_DRAFTS (fixed before drafting, so any count is lossless).
    Padding is filled with garbage that must not matter."""
    vocab, width = models.vocab, MAX_DRAFTS
    p = models.p.to(device=device, dtype=torch.float32)
    q = models.q.to(device=device, dtype=torch.float32)
    rows = torch.arange(num, device=device)
    prefix = torch.zeros(num, dtype=torch.long, device=device)
    length = torch.zeros(num, dtype=torch.long, device=device)
    tokens = torch.full((num, HORIZON + width + 1), -1, device=device)
    for _ in range(HORIZON):  # every step emits at least one token
        active = length < HORIZON
        num_drafts = torch.randint(width + 1, (num,), generator=generator, device=device)
        num_drafts = torch.where(active, num_drafts, 0)
        current = torch.where(active, prefix, 0)
        target = torch.empty(num, width + 1, vocab, device=device)
        draft_probs = torch.empty(num, width, vocab, device=device)
        drafts = torch.empty(num, width, dtype=torch.long, device=device)
        for i in range(width):
            target[:, i], draft_probs[:, i] = p[current], q[current]
            if drafter == "sampled":
                drafts[:, i] = torch.multinomial(draft_probs[:, i], 1, generator=generator)[:, 0]
            else:
                drafts[:, i] = draft_probs[:, i].argmax(dim=-1)
            current = current * vocab + drafts[:, i] + 1
        target[:, width] = p[current]
        positions = torch.arange(width + 1, device=device)
        drafts = torch.where(positions[:width] < num_drafts[:, None], drafts, -7)
        target[positions > num_drafts[:, None]] = float("nan")
        draft_probs[positions[:width] >= num_drafts[:, None]] = float("nan")
        uniforms = torch.rand(num, width, generator=generator, device=device)
        exponentials = torch.empty(num, vocab, device=device).exponential_(generator=generator)
        t, out = VERIFIERS[method](target, drafts, num_drafts,
                                   draft_probs if drafter == "sampled" else None,
                                   uniforms, exponentials)
        for j in range(width + 1):
            keep = active & (j <= t)
            column = (length + j).clamp(max=tokens.shape[1] - 1)
            tokens[rows, column] = torch.where(keep, out[:, j], tokens[rows, column])
            prefix = torch.where(keep, prefix * vocab + out[:, j] + 1, prefix)
        length = length + torch.where(active, t + 1, 0)
    assert bool((length >= HORIZON).all())
    return tokens[:, :HORIZON]


def _plain_sampling(models: ToyModels, num: int, generator: torch.Generator,
                    device: torch.device) -> torch.Tensor:
    p = models.p.to(device=device, dtype=torch.float32)
    prefix = torch.zeros(num, dtype=torch.long, device=device)
    tokens = []
    for _ in range(HORIZON):
        x = torch.multinomial(p[prefix], 1, generator=generator)[:, 0]
        tokens.append(x)
        prefix = prefix * models.vocab + x + 1
    return torch.stack(tokens, dim=1)


def _fit(models: ToyModels, tokens: torch.Tensor) -> tuple[float, float, int]:
    """(total variation, chi-square p-value, samples in cells of probability 0) against the exact
    joint; cells expecting fewer than 5 samples are pooled."""
    vocab = models.vocab
    sequences = list(itertools.product(range(vocab), repeat=HORIZON))
    exact = torch.tensor([models.target_prob((), s) for s in sequences], dtype=torch.float64)
    codes = (tokens.cpu() * vocab ** torch.arange(HORIZON - 1, -1, -1)).sum(dim=-1)
    counts = torch.bincount(codes, minlength=len(sequences)).double()
    num = tokens.shape[0]
    tv = 0.5 * float((counts / num - exact).abs().sum())
    expected = num * exact
    small = (expected < 5) & (exact > 0)
    observed, expected = counts[expected >= 5], expected[expected >= 5]
    if small.any():
        observed = torch.cat([observed, counts[small].sum()[None]])
        expected = torch.cat([expected, num * exact[small].sum()[None]])
    statistic = float(((observed - expected) ** 2 / expected).sum())
    p_value = float(chi2_distribution.sf(statistic, len(observed) - 1))
    return tv, p_value, int(counts[exact == 0].sum())


def _monte_carlo(method: str, drafter: str, device: torch.device, seed: int = 0
                 ) -> tuple[tuple[float, float, int], tuple[float, float, int]]:
    models = MismatchedModels(max_len=HORIZON + MAX_DRAFTS, seed=0)
    generator = torch.Generator(device=device).manual_seed(seed)
    plain = _fit(models, _plain_sampling(models, NUM_SAMPLES, generator, device))
    speculative = _fit(models, _speculative_loop(method, models, drafter, NUM_SAMPLES,
                                                 generator, device))
    return plain, speculative


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("drafter", ["sampled", "greedy"])
def test_monte_carlo_matches_target(method: str, drafter: str, device: torch.device) -> None:
    (plain_tv, plain_p, plain_zero), (tv, p_value, zero) = _monte_carlo(method, drafter, device)
    assert plain_zero == 0 and zero == 0  # never a sequence the target cannot produce
    assert plain_p > 1e-3 and p_value > 1e-3
    assert tv < 1.5 * plain_tv + 0.003


@pytest.mark.parametrize("control", CONTROLS)
def test_monte_carlo_rejects_controls(control: str, monkeypatch: pytest.MonkeyPatch) -> None:
    CONTROLS[control](monkeypatch)
    _, (_, p_value, _) = _monte_carlo("block", "sampled", torch.device("cpu"))
    # The unweighted residual moves little mass (a total variation of about 0.007 here, barely
    # above the noise of 0.004), so it is the chi-square test that must reject it.
    assert p_value < 1e-8


# --- Greedy and ragged batches -----------------------------------------------------------------

def test_greedy_matches_a_per_request_loop(device: torch.device) -> None:
    generator = torch.Generator().manual_seed(5)
    num, width, vocab = 64, 5, 11
    logits = torch.randn(num, width + 1, vocab, generator=generator)
    best = logits.argmax(dim=-1)
    drafts = best[:, :width].clone()
    wrong = torch.rand(num, width, generator=generator) < 0.25
    drafts[wrong] = (drafts[wrong] + 1) % vocab
    num_drafts = torch.randint(width + 1, (num,), generator=generator)
    drafts[torch.arange(width) >= num_drafts[:, None]] = -1  # padding
    logits[torch.arange(width + 1) > num_drafts[:, None]] = float("nan")
    t, out = verify_greedy(logits.to(device), drafts.to(device), num_drafts.to(device))
    for r in range(num):
        accepted = 0
        while accepted < num_drafts[r] and drafts[r, accepted] == best[r, accepted]:
            accepted += 1
        expected = drafts[r, :accepted].tolist() + [int(best[r, accepted])]
        expected += [-1] * (width + 1 - len(expected))
        assert int(t[r]) == accepted
        assert out[r].tolist() == expected


def test_greedy_rows_of_a_verify_graph_match_greedy_verification(device: torch.device
                                                                   ) -> None:
    """The layout a verify CUDA graph holds (a row per request, query rows padded with
    garbage past 1 + its drafts) gives `verify_greedy`'s counts and emitted tokens."""
    generator = torch.Generator().manual_seed(11)
    num, query_len, vocab = 64, 6, 9
    logits = torch.randn(num, query_len, vocab, generator=generator)
    best = logits.argmax(dim=-1)
    num_tokens = torch.randint(1, query_len + 1, (num,), generator=generator)
    drafts = best[:, :query_len - 1].clone()
    wrong = torch.rand(num, query_len - 1, generator=generator) < 0.25
    drafts[wrong] = (drafts[wrong] + 1) % vocab
    padding = torch.arange(query_len - 1) >= (num_tokens - 1)[:, None]
    # Padding tokens that would extend the accepted run if the count ignored them.
    drafts[padding] = best[:, :query_len - 1][padding]
    last = torch.randint(vocab, (num, 1), generator=generator)
    input_ids = torch.cat([last, drafts], dim=1)
    rows = verification.verify_greedy_rows(best.to(device), input_ids.to(device),
                                           num_tokens.to(device))
    t, out = verify_greedy(logits.to(device), drafts.to(device), (num_tokens - 1).to(device))
    assert rows[:, 0].tolist() == t.tolist()
    for r in range(num):
        emitted = rows[r, 1:int(t[r]) + 2].tolist()
        assert emitted == out[r, :int(t[r]) + 1].tolist()


def _ragged_batch(seed: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Random inputs with g_r = 0..G, NaN in every padded probability and garbage in padded
    tokens and uniforms."""
    generator = torch.Generator().manual_seed(seed)
    width, vocab = 4, 6
    num_drafts = torch.tensor([0, 4, 2, 1, 4, 3, 0, 2])
    num = num_drafts.shape[0]
    target = _random_rows(num * (width + 1), vocab, generator).float().reshape(num, width + 1,
                                                                               vocab)
    draft_probs = _random_rows(num * width, vocab, generator).float().reshape(num, width, vocab)
    draft_probs[1, 2] = target[1, 2]  # q = p at one position
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1,
                               generator=generator).reshape(num, width)
    positions = torch.arange(width + 1)
    target[positions > num_drafts[:, None]] = float("nan")
    draft_probs[positions[:width] >= num_drafts[:, None]] = float("nan")
    drafts[positions[:width] >= num_drafts[:, None]] = 10 ** 6
    uniforms = torch.rand(num, width, generator=generator)
    uniforms[positions[:width] >= num_drafts[:, None]] = -1.0
    exponentials = torch.empty(num, vocab).exponential_(generator=generator)
    batch = dict(target_probs=target, draft_tokens=drafts, num_drafts=num_drafts,
                 draft_probs=draft_probs, uniforms=uniforms, exponentials=exponentials)
    return {name: value.to(device) for name, value in batch.items()}


@pytest.mark.parametrize("method", ["token", "block"])
@pytest.mark.parametrize("one_hot", [False, True])
def test_ragged_batch_equals_requests_alone(method: str, one_hot: bool,
                                            device: torch.device) -> None:
    verify = VERIFIERS[method]
    for seed in range(20):
        batch = _ragged_batch(seed, device)
        if one_hot:
            batch["draft_probs"] = None
        t, out = verify(**batch)
        law = verification_law(method, batch["target_probs"], batch["draft_tokens"],
                               batch["num_drafts"], batch["draft_probs"])
        assert t.device == out.device == batch["target_probs"].device
        for r, g in enumerate(batch["num_drafts"].tolist()):
            alone = {name: None if value is None else
                     value[r:r + 1, :g + 1] if name == "target_probs" else
                     value[r:r + 1] if name in ("num_drafts", "exponentials") else
                     value[r:r + 1, :g]
                     for name, value in batch.items()}
            t_alone, out_alone = verify(**alone)
            accepted = int(t[r])
            assert accepted == int(t_alone[0]) and accepted <= g
            assert out[r, :g + 1].tolist() == out_alone[0].tolist()
            assert out[r, :accepted].tolist() == batch["draft_tokens"][r, :accepted].tolist()
            assert (out[r, accepted + 1:] == -1).all()
            assert law.final_probs[r, accepted, out[r, accepted]] > 0


@pytest.mark.parametrize("method", ["token", "block"])
def test_no_drafts_samples_the_first_target_distribution(method: str,
                                                         device: torch.device) -> None:
    generator = torch.Generator().manual_seed(6)
    num, vocab = 4096, 5
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0], device=device).expand(num, 1, vocab)
    exponentials = torch.empty(num, vocab).exponential_(generator=generator).to(device)
    t, out = VERIFIERS[method](probs, torch.empty(num, 0, dtype=torch.long, device=device),
                               torch.zeros(num, dtype=torch.long, device=device), None,
                               torch.empty(num, 0, device=device), exponentials)
    assert out.shape == (num, 1) and (t == 0).all()
    torch.testing.assert_close(out[:, 0], (probs[:, 0] / exponentials).argmax(dim=-1))
    frequencies = torch.bincount(out[:, 0].cpu(), minlength=vocab) / num
    assert frequencies[1] == 0 and frequencies[4] == 0
    torch.testing.assert_close(frequencies, probs[0, 0].cpu(), rtol=0, atol=0.03)

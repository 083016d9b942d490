"""The sampler on hand-made logits: draws follow the filtered distribution, processing is exact."""

import math

import pytest
import torch
from scipy.stats import chisquare

from muse.engine.sampler import SamplingRow, apply_logit_processing, sample
from muse.engine.sampling_params import SamplingParams
from tests.conftest import DEVICE

NUM_DRAWS = 20000
EOS = (2, 7)
# Distinct values, so no ranking depends on how ties are broken.
LOGITS = [2.0, 1.6, 1.1, 0.7, 0.2, -0.4, -1.0, -1.9]
COMBINED = dict(temperature=0.8, top_k=5, top_p=0.93, min_p=0.15)
COMBINED_MIN_P = dict(temperature=1.3, top_k=7, top_p=0.9, min_p=0.3)


def row(params: SamplingParams, prompt=(), output=(), generator=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), list(output), EOS, generator)


def expected_distribution(logits: list[float], temperature: float = 1.0, top_k: int = 0,
                          top_p: float = 1.0, min_p: float = 0.0) -> list[float]:
    """The sampling distribution, worked out in float64 in the documented order."""
    scaled = [value / temperature for value in logits]
    order = sorted(range(len(logits)), key=lambda i: -scaled[i])
    if top_k:
        order = order[:top_k]
    weights = {i: math.exp(scaled[i]) for i in order}
    total = sum(weights.values())
    # Walk down from the most likely token; stop once the kept ones reach top_p.
    kept, reached = [], 0.0
    for i in order:
        if kept and reached >= top_p:
            break
        kept.append(i)
        reached += weights[i] / total
        # A p sitting on a cumulative sum would make the kept set hinge on rounding.
        assert top_p == 1.0 or abs(reached - top_p) > 1e-3
    probs = {i: weights[i] for i in kept}
    total = sum(probs.values())
    probs = {i: p / total for i, p in probs.items()}
    if min_p:
        highest = max(probs.values())
        probs = {i: p for i, p in probs.items() if p >= min_p * highest}
        total = sum(probs.values())
        probs = {i: p / total for i, p in probs.items()}
    return [probs.get(i, 0.0) for i in range(len(logits))]


def draw_counts(logits: list[float], params: SamplingParams, seed: int = 0) -> list[int]:
    """Token counts of NUM_DRAWS draws from one batch of identical rows."""
    torch.manual_seed(seed)
    batch = torch.tensor(logits, device=DEVICE).repeat(NUM_DRAWS, 1)
    tokens, _ = sample(batch, [row(params)] * NUM_DRAWS)
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).tolist()


def assert_follows(counts: list[int], expected: list[float]) -> None:
    excluded = [i for i, p in enumerate(expected) if p == 0.0]
    assert [counts[i] for i in excluded] == [0] * len(excluded)
    kept = [i for i, p in enumerate(expected) if p > 0.0]
    assert len(kept) > 1  # a one-token distribution would make the fit test vacuous
    observed = [counts[i] for i in kept]
    assert sum(observed) == NUM_DRAWS
    result = chisquare(observed, [expected[i] * NUM_DRAWS for i in kept])
    assert result.pvalue > 1e-3, (observed, [round(expected[i] * NUM_DRAWS) for i in kept])


@pytest.mark.parametrize("case", [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=3),
    dict(temperature=1.0, top_p=0.75),
    dict(temperature=1.3, min_p=0.2),
    COMBINED,
    COMBINED_MIN_P,
], ids=["temperature", "top_k", "top_p", "min_p", "combined", "combined_min_p"])
def test_draws_follow_the_filtered_distribution(case):
    expected = expected_distribution(LOGITS, **case)
    counts = draw_counts(LOGITS, SamplingParams(**case))
    assert_follows(counts, expected)


def test_the_cases_really_cut():
    """Each filter case removes tokens, and the combinations depend on the order of filters."""
    def num_kept(**case):
        return sum(p > 0 for p in expected_distribution(LOGITS, **case))

    assert num_kept(top_k=3) == 3
    assert num_kept(top_p=0.75) == 3
    assert num_kept(temperature=1.3, min_p=0.2) == 5
    # top_p works on the distribution top_k renormalised, so together they keep fewer tokens
    # than either alone.
    assert num_kept(**COMBINED) == 4
    assert num_kept(temperature=0.8, top_k=5) == 5
    assert num_kept(temperature=0.8, top_p=0.93) == 5
    # Here min_p is the tightest filter.
    assert num_kept(**COMBINED_MIN_P) == 4
    assert num_kept(**{**COMBINED_MIN_P, "min_p": 0.0}) == 5


@pytest.mark.parametrize("top_p, kept", [
    (0.3, {0}),  # the most likely token is always kept
    (0.79, {0, 1}),  # 0.5 + 0.3 already reach 0.79, so the third token is dropped
    (0.81, {0, 1, 2}),  # 0.5 + 0.3 fall short of 0.81, so the third token is still needed
    (0.96, {0, 1, 2, 3}),
])
def test_top_p_kept_set(top_p, kept):
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    counts = draw_counts(logits, SamplingParams(temperature=1.0, top_p=top_p))
    assert {i for i, c in enumerate(counts) if c} == kept
    expected = expected_distribution(logits, top_p=top_p)
    assert {i for i, p in enumerate(expected) if p} == kept
    if len(kept) > 1:
        assert_follows(counts, expected)


def test_greedy_is_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 50, device=DEVICE) * 3
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=2.0)
    rows = [row(greedy), row(hot), row(greedy), row(hot), row(greedy), row(greedy)]
    tokens, logprobs = sample(logits, rows)
    for i in (0, 2, 4, 5):
        assert tokens[i] == int(logits[i].argmax())
    assert logprobs == [None] * 6


def test_logit_bias_shifts_the_choice():
    logits = torch.tensor([LOGITS], device=DEVICE)
    assert sample(logits, [row(SamplingParams(temperature=0.0))])[0] == [0]
    # Token 3 is 1.3 below the best; a bias of 1.5 lifts it to the top, 1.0 does not.
    assert sample(logits, [row(SamplingParams(temperature=0.0, logit_bias={3: 1.5}))])[0] == [3]
    assert sample(logits, [row(SamplingParams(temperature=0.0, logit_bias={3: 1.0}))])[0] == [0]
    assert sample(logits, [row(SamplingParams(temperature=0.0,
                                              logit_bias={0: -0.5}))])[0] == [1]
    processed = apply_logit_processing(logits, [row(SamplingParams(logit_bias={3: 1.5,
                                                                              6: -2}))])
    want = list(LOGITS)
    want[3] += 1.5
    want[6] -= 2
    torch.testing.assert_close(processed, torch.tensor([want], device=DEVICE))


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.5, 0.1, 3.0, -0.2, 0.9, 0.0, 1.1, 2.5, 0.3, -1.0, 0.4, 2.8]],
                          device=DEVICE).repeat(4, 1)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11])
    no_eos = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11], ignore_eos=True)
    rows = [row(params, output=[20, 21]),  # two outputs: still under min_tokens
            row(params, output=[20, 21, 22]),  # min_tokens reached: nothing masked
            row(no_eos, output=[20]),  # ignore_eos: only the stop token id is masked
            row(SamplingParams(temperature=0.0), output=[])]  # no min_tokens
    processed = apply_logit_processing(logits, rows)
    inf = float("-inf")
    masked = logits[0].clone()
    masked[[2, 7, 11]] = inf
    torch.testing.assert_close(processed[0], masked)
    torch.testing.assert_close(processed[1], logits[1])
    only_stop = logits[2].clone()
    only_stop[11] = inf
    torch.testing.assert_close(processed[2], only_stop)
    torch.testing.assert_close(processed[3], logits[3])
    # Token 2 (an eos) is the argmax; under min_tokens the next best that is no stop wins.
    assert sample(logits, rows)[0] == [6, 2, 2, 2]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]], device=DEVICE).repeat(2, 1)
    rows = [row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 1], output=[2, 3, 2]),
            row(SamplingParams(repetition_penalty=0.5), prompt=[4], output=[1])]
    processed = apply_logit_processing(logits, rows)
    want = torch.tensor([[1.0, -2.0, 0.25, -1.0, 3.0, 1.0],  # prompt and output, once each
                         [2.0, -0.5, 0.5, -0.5, 6.0, 1.0]], device=DEVICE)
    torch.testing.assert_close(processed, want)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]], device=DEVICE).repeat(3, 1)
    rows = [row(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
                prompt=[1, 4, 4], output=[0, 0, 3, 0]),
            row(SamplingParams(presence_penalty=-1.0), prompt=[2], output=[2, 4, 4]),
            row(SamplingParams(), prompt=[0], output=[0, 1])]
    processed = apply_logit_processing(logits, rows)
    want = torch.tensor([
        [2.0 - 0.5 - 3 * 0.25, -1.0, 0.5, -0.5 - 0.5 - 0.25, 3.0],
        [2.0, -1.0, 0.5 + 1.0, -0.5, 3.0 + 1.0],
        [2.0, -1.0, 0.5, -0.5, 3.0]], device=DEVICE)
    torch.testing.assert_close(processed, want)


def test_bias_then_penalties_in_order():
    logits = torch.tensor([[1.0, -1.0, 0.5]], device=DEVICE)
    params = SamplingParams(logit_bias={0: 1.0, 1: 3.0}, repetition_penalty=2.0,
                            frequency_penalty=0.5)
    processed = apply_logit_processing(logits, [row(params, prompt=[0], output=[1, 1])])
    # bias: [2, 2, 0.5]; repetition on 0 and 1: [1, 1, 0.5]; frequency on 1 (twice): [1, 0, 0.5]
    torch.testing.assert_close(processed, torch.tensor([[1.0, 0.0, 0.5]], device=DEVICE))


def seeded_tokens(seed: int, position: int, companions: list, steps: int = 24,
                  global_seed: int = 0) -> list[int]:
    """Tokens drawn for one seeded row over several steps, at `position` among `companions`."""
    torch.manual_seed(global_seed)
    logits = torch.linspace(1.5, -1.5, 64, device=DEVICE)
    params = SamplingParams(temperature=1.0, seed=seed)
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    others = [row(SamplingParams(temperature=1.0, seed=s),
                  generator=None if s is None else torch.Generator(device=DEVICE).manual_seed(s))
              for s in companions]
    rows = others[:position] + [row(params, generator=generator)] + others[position:]
    got = []
    for _ in range(steps):
        tokens, _ = sample(logits.repeat(len(rows), 1), rows)
        got.append(tokens[position])
    return got


def test_a_seed_gives_the_same_tokens_alone_or_in_any_batch():
    alone = seeded_tokens(1234, 0, [])
    assert len(set(alone)) > 5  # really random draws, not a constant
    assert seeded_tokens(1234, 2, [None, 99, None, 5], global_seed=7) == alone
    assert seeded_tokens(1234, 1, [None], global_seed=8) == alone
    assert seeded_tokens(1234, 0, [1234, 1234]) == alone
    assert seeded_tokens(1235, 0, []) != alone
    # Without a seed, draws follow the global generator.
    unseeded = [row(SamplingParams(temperature=1.0))]
    logits = torch.linspace(1.5, -1.5, 64, device=DEVICE)[None]
    torch.manual_seed(3)
    first = [sample(logits, unseeded)[0][0] for _ in range(24)]
    torch.manual_seed(4)
    second = [sample(logits, unseeded)[0][0] for _ in range(24)]
    assert first != second


def test_logprobs_are_those_of_the_raw_logits():
    torch.manual_seed(0)
    vocab = 32
    logits = torch.randn(4, vocab, device=DEVICE) * 2
    worst = int(logits[2].argmin())
    rows = [row(SamplingParams(temperature=0.0, logprobs=5)),
            row(SamplingParams(temperature=1.0, logprobs=3, logit_bias={5: 4.0},
                               repetition_penalty=1.5), prompt=[1, 2, 3]),
            row(SamplingParams(temperature=0.0, logprobs=0, logit_bias={worst: 100.0})),
            row(SamplingParams(temperature=0.0))]
    tokens, logprobs = sample(logits, rows)
    raw = logits.double().log_softmax(dim=-1).cpu()
    assert tokens[2] == worst
    assert logprobs[3] is None
    for i, num_top in enumerate((5, 3, 0)):
        entry = logprobs[i]
        values = raw[i].tolist()
        chosen = values[tokens[i]]
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(chosen, abs=1e-5)
        assert entry.rank == 1 + sum(v > chosen for v in values)
        ranked = sorted(range(vocab), key=lambda t: -values[t])[:num_top]
        assert [token for token, _ in entry.top] == ranked
        assert [value for _, value in entry.top] == pytest.approx([values[t] for t in ranked],
                                                                   abs=1e-5)
    assert logprobs[0].rank == 1
    assert logprobs[2].rank == vocab
    assert logprobs[2].top == []

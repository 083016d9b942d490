"""Shared pieces of the engine tests: a tiny engine, a reference greedy decoder, prompt sets,
and the comparison of runs that were batched differently."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from muse import LLM
from muse.engine.request import TokenLogprobs
from muse.outputs import CompletionOutput, RequestOutput
from muse.checkpoint import load_reference_model
from muse.presets import PRESETS
from muse.reference.model import MuseForCausalLM
from tests.conftest import DEVICE

# Runs batched differently (chunked prefill, prefix-cache hits, other requests in the batch,
# padded CUDA graphs, the reference model) sum the same float32 terms in another order, so a
# logprob moves by a few ulps of the terms: up to 5e-6 on the CPU between one chunked batch and
# each prompt alone. 1e-4 leaves room for GPU kernels' other reduction orders and is still far
# below what a real bug changes: one wrong or missing cache entry moves the tiny model's next
# logprobs by a nat or more.
LOGPROB_ATOL = 1e-4
LOGPROB_RTOL = 1e-4
# Two runs' logits differ by that same float noise, and an argmax can only flip where the
# top-1/top-2 gap is below twice their difference: greedy runs are compared only where the gap
# is wider than twice the tolerance (40 times the noise measured), as strict as the logprobs.
MIN_GREEDY_GAP = 2 * LOGPROB_ATOL


def tiny_llm(**engine_args) -> LLM:
    """The tiny preset in float32 on the test device."""
    # An explicit KV budget: on a GPU the default takes most of the free memory, which would
    # leave nothing for the next engine a test builds.
    engine_args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    return LLM("muse-spark-tiny", init_std=0.1, device=DEVICE, dtype="float32", **engine_args)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 8192) for _ in range(length)]


def reference_from_engine(engine) -> MuseForCausalLM:
    """A float32 reference model with the engine's weights: the same preset seed or the same
    checkpoint, rounded to the engine's dtype as the engine's copy was."""
    args = engine.args
    if args.model in PRESETS:
        reference = MuseForCausalLM(engine.config)
        reference.init_weights(args.seed, args.init_std)
    else:
        reference = load_reference_model(args.model)
    return reference.to(engine.dtype).float().eval()


@torch.no_grad()
def reference_greedy(model: MuseForCausalLM, prompts: list[list[int]], max_tokens: int
                     ) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (one left-padded batch per step), and the smallest
    top-1/top-2 logit gap met on the way."""
    sequences = [list(p) for p in prompts]
    smallest_gap = float("inf")
    for _ in range(max_tokens):
        width = max(len(s) for s in sequences)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        logits = model(ids, attention_mask=mask).logits[:, -1]
        top = logits.topk(2).values
        smallest_gap = min(smallest_gap, float((top[:, 0] - top[:, 1]).min()))
        for sequence, token in zip(sequences, logits.argmax(-1).tolist()):
            sequence.append(token)
    return [s[len(p):] for s, p in zip(sequences, prompts)], smallest_gap


def mixed_prompts(vocab: int, window: int, count: int = 32, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed length, several over 3x the window, some sharing long prefixes."""
    rng = random.Random(seed)
    shared = [rng.randrange(32, vocab) for _ in range(3 * window + 5)]
    prompts = []
    for i in range(count):
        if i % 4 == 0:
            length = rng.randrange(3 * window + 1, 5 * window)
        else:
            length = rng.randrange(2, 2 * window)
        tokens = [rng.randrange(32, vocab) for _ in range(length)]
        if i % 3 == 0:
            tokens = shared[:rng.randrange(window, len(shared))] + tokens
        prompts.append(tokens)
    return prompts


@torch.no_grad()
def greedy_gap(reference: MuseForCausalLM, prompt: list[int], continuation: list[int]) -> float:
    """The smallest top-1/top-2 logit gap of `reference` where it predicts the tokens of
    `continuation` after `prompt`. Asserts each token is the reference's argmax (once the gap
    is wide, that is the engine-vs-reference check too)."""
    ids = torch.tensor([prompt + continuation[:-1]])
    top = reference(ids).logits[0, len(prompt) - 1:].topk(2)
    gaps = top.values[:, 0] - top.values[:, 1]
    position = int(gaps.argmin())
    assert float(gaps[position]) > MIN_GREEDY_GAP, (
        f"greedy choice {position} of prompt {prompt[:8]}... is a near tie (top-1/top-2 gap "
        f"{float(gaps[position]):.2e} <= {MIN_GREEDY_GAP}): batching could flip it, pick "
        f"another prompt")
    assert top.indices[:, 0].tolist() == continuation, "the engine's greedy tokens are not " \
        "the reference model's"
    return float(gaps[position])


def assert_greedy_is_well_defined(llm: LLM, prompts: Sequence[list[int]],
                                  continuations: Sequence[list[int]]) -> None:
    """Fail unless every greedy continuation (no penalties, no logit bias) has a top-1/top-2
    logit gap above MIN_GREEDY_GAP at each token: a test that compares greedy runs batched
    differently is otherwise comparing float noise."""
    reference = reference_from_engine(llm.engine)
    for prompt, continuation in zip(prompts, continuations, strict=True):
        greedy_gap(reference, list(prompt), list(continuation))


def reference_token_logprobs(logprobs: torch.Tensor, token: int, num_top: int) -> TokenLogprobs:
    """What the engine reports for one position, from the reference's log-softmax row."""
    chosen = float(logprobs[token])
    top = logprobs.topk(num_top)
    return TokenLogprobs(token_id=token, logprob=chosen, rank=1 + int((logprobs > chosen).sum()),
                         top=list(zip(top.indices.tolist(), top.values.tolist())))


def _near(value: float, other: float, atol: float, rtol: float) -> bool:
    """torch.testing.assert_close's rule for one pair of floats."""
    return abs(value - other) <= atol + rtol * abs(other)


def _assert_close(got: float | list[float], want: float | list[float], atol: float,
                  rtol: float, where: str) -> None:
    torch.testing.assert_close(torch.tensor(got, dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), atol=atol, rtol=rtol,
                               msg=lambda message: f"{where}: {message}")


def assert_same_token_logprobs(got: TokenLogprobs, want: TokenLogprobs, where: str = "",
                               atol: float = LOGPROB_ATOL, rtol: float = LOGPROB_RTOL) -> None:
    """One position's logprobs: the chosen token exactly, values within the tolerance.

    The top-k ids are ordered by value, so two candidates within float noise of each other
    may swap places, and one tied with the last entry may be in one run's top-k and not the
    other's. So the ids are compared as a mapping id -> logprob: an id in both lists has the
    same value within the tolerance, and an id in one list only must be tied with the other
    list's last value (had it been clearly above it, the other run would have listed it too).
    The values by position are compared too: swapping near-tied ids does not change them.
    """
    assert got.token_id == want.token_id, f"{where}: token {got.token_id} != {want.token_id}"
    _assert_close(got.logprob, want.logprob, atol, rtol, f"{where}: chosen logprob")
    assert len(got.top) == len(want.top), f"{where}: {len(got.top)} top entries, not " \
        f"{len(want.top)}"
    _assert_close([v for _, v in got.top], [v for _, v in want.top], atol, rtol,
                  f"{where}: top logprobs by position")
    got_top, want_top = dict(got.top), dict(want.top)
    for token in got_top.keys() & want_top.keys():
        _assert_close(got_top[token], want_top[token], atol, rtol, f"{where}: top token {token}")
    for mine, theirs, name in ((got_top, want_top, "got"), (want_top, got_top, "want")):
        for token in mine.keys() - theirs.keys():
            last = min(theirs.values())
            assert _near(mine[token], last, atol, rtol), (
                f"{where}: top token {token} ({mine[token]:.6f}) only in {name}'s top-k and "
                f"not tied with the other's last value {last:.6f}")
    # A rank counts the tokens more likely than the chosen one, so a near tie shifts it. Ties
    # are visible only inside the top-k: ranks are compared where the chosen token is listed
    # in both runs and no listed token could have swapped with it (values within twice the
    # tolerance, each run's error being up to once it).
    visible = got.rank <= len(got.top) and want.rank <= len(want.top)
    tied = any(_near(value, got.logprob, 2 * atol, 2 * rtol)
               for top in (got_top, want_top) for token, value in top.items()
               if token != got.token_id)
    if visible and not tied:
        assert got.rank == want.rank, f"{where}: rank {got.rank} != {want.rank}"


def assert_same_logprobs(got: Sequence[TokenLogprobs | None] | None,
                         want: Sequence[TokenLogprobs | None] | None, where: str = "",
                         atol: float = LOGPROB_ATOL, rtol: float = LOGPROB_RTOL) -> None:
    """Per-position logprobs (of outputs or of a prompt) of two runs, as in
    assert_same_token_logprobs; positions without logprobs must be the same ones."""
    assert (got is None) == (want is None), f"{where}: logprobs {got is not None} vs " \
        f"{want is not None}"
    if got is None or want is None:
        return
    assert len(got) == len(want), f"{where}: {len(got)} positions, not {len(want)}"
    for position, (mine, theirs) in enumerate(zip(got, want)):
        assert (mine is None) == (theirs is None), f"{where}, position {position}: None"
        if mine is not None and theirs is not None:
            assert_same_token_logprobs(mine, theirs, f"{where}, position {position}", atol, rtol)


def _assert_same_completion(got: CompletionOutput, want: CompletionOutput, where: str,
                            atol: float, rtol: float) -> None:
    assert got.index == want.index, f"{where}: index {got.index} != {want.index}"
    assert got.token_ids == want.token_ids, f"{where}: tokens {got.token_ids} != {want.token_ids}"
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason), (
        f"{where}: finished by {got.finish_reason, got.stop_reason}, not "
        f"{want.finish_reason, want.stop_reason}")
    assert got.text == want.text, f"{where}: text {got.text!r} != {want.text!r}"
    assert_same_logprobs(got.logprobs, want.logprobs, f"{where} logprobs", atol, rtol)
    assert (got.cumulative_logprob is None) == (want.cumulative_logprob is None), where
    if got.cumulative_logprob is not None:
        # A sum of one logprob a token: each term brings its own error.
        _assert_close(got.cumulative_logprob, want.cumulative_logprob,
                      atol * max(1, len(got.token_ids)), rtol, f"{where}: cumulative logprob")


def assert_same_outputs(got: Sequence[RequestOutput] | Sequence[CompletionOutput],
                        want: Sequence[RequestOutput] | Sequence[CompletionOutput],
                        atol: float = LOGPROB_ATOL, rtol: float = LOGPROB_RTOL) -> None:
    """Two runs of the same requests, batched differently, agree: token ids, text and finish
    and stop reasons exactly; logprobs (chosen, top-k, cumulative, prompt) within the float
    tolerance. Request ids and prefix-cache hits are the runs' own and are not compared."""
    assert len(got) == len(want), f"{len(got)} outputs, not {len(want)}"
    for number, (mine, theirs) in enumerate(zip(got, want)):
        where = f"output {number}"
        assert type(mine) is type(theirs), f"{where}: {type(mine)} vs {type(theirs)}"
        if isinstance(mine, CompletionOutput):
            _assert_same_completion(mine, theirs, where, atol, rtol)
            continue
        assert mine.prompt_token_ids == theirs.prompt_token_ids, f"{where}: prompts differ"
        assert len(mine.outputs) == len(theirs.outputs), f"{where}: number of samples"
        for sample, (completion, expected) in enumerate(zip(mine.outputs, theirs.outputs)):
            _assert_same_completion(completion, expected, f"{where} sample {sample}", atol, rtol)
        assert_same_logprobs(mine.prompt_logprobs, theirs.prompt_logprobs,
                             f"{where} prompt logprobs", atol, rtol)

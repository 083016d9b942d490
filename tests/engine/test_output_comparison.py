"""The comparison of runs batched differently: exact where it must be, tolerant of float
noise only, and still failing on a wrong token or a logprob off by 1e-2."""

from __future__ import annotations

import copy

import pytest

from muse.engine.request import TokenLogprobs
from muse.outputs import CompletionOutput, RequestOutput
from tests.engine.helpers import assert_same_outputs


def entry(token_id: int, logprob: float, top: list[tuple[int, float]], rank: int = 1
          ) -> TokenLogprobs:
    return TokenLogprobs(token_id=token_id, logprob=logprob, rank=rank, top=top)


def outputs() -> list[RequestOutput]:
    logprobs = [entry(7, -0.5, [(7, -0.5), (9, -1.25), (4, -3.0)]),
                entry(9, -1.0, [(9, -1.0), (3, -1.5), (11, -2.0)]),
                entry(3, -2.5, [(5, -0.75), (6, -1.0), (8, -2.0)], rank=4)]
    sample = CompletionOutput(index=0, text="abc", token_ids=[7, 9, 3],
                              cumulative_logprob=-4.0, logprobs=logprobs,
                              finish_reason="stop", stop_reason=3)
    plain = CompletionOutput(index=1, text="de", token_ids=[1, 2], cumulative_logprob=None,
                             logprobs=None, finish_reason="length")
    prompt_logprobs = [None, entry(12, -4.0, [(13, -2.0)], rank=3)]
    return [RequestOutput("0", None, [10, 12], [sample, plain], prompt_logprobs),
            RequestOutput("1", None, [14], [copy.deepcopy(plain)])]


def shifted(outputs: list[RequestOutput], by: float) -> list[RequestOutput]:
    """Every logprob moved by `by`, as a run with other rounding would move them."""
    moved = copy.deepcopy(outputs)
    for output in moved:
        entries = [e for c in output.outputs for e in c.logprobs or []]
        entries += [e for e in output.prompt_logprobs or [] if e is not None]
        for e in entries:
            e.logprob += by
            e.top = [(token, value + by) for token, value in e.top]
        for completion in output.outputs:
            if completion.cumulative_logprob is not None:
                completion.cumulative_logprob += by * len(completion.token_ids)
    return moved


def test_equal_outputs_pass():
    assert_same_outputs(outputs(), outputs())
    assert_same_outputs(outputs()[0].outputs, outputs()[0].outputs)


def test_float_noise_passes():
    assert_same_outputs(shifted(outputs(), 1e-6), outputs())
    assert_same_outputs(shifted(outputs(), -1e-6), outputs())


@pytest.mark.parametrize("by", [1e-2, -1e-2])
def test_a_logprob_off_by_a_hundredth_fails(by):
    with pytest.raises(AssertionError, match="chosen logprob"):
        assert_same_outputs(shifted(outputs(), by), outputs())
    changed = outputs()
    changed[0].outputs[0].logprobs[2].logprob += by
    with pytest.raises(AssertionError, match="position 2: chosen logprob"):
        assert_same_outputs(changed, outputs())
    for where in ("top", "prompt"):
        changed = outputs()
        target = changed[0].outputs[0].logprobs[1] if where == "top" else \
            changed[0].prompt_logprobs[1]
        token, value = target.top[0]
        target.top[0] = (token, value + by)
        with pytest.raises(AssertionError):
            assert_same_outputs(changed, outputs())
    changed = outputs()
    changed[0].outputs[0].cumulative_logprob += by
    with pytest.raises(AssertionError, match="cumulative"):
        assert_same_outputs(changed, outputs())


def test_a_different_token_fails():
    changed = outputs()
    changed[0].outputs[0].token_ids[1] = 8
    with pytest.raises(AssertionError, match="tokens"):
        assert_same_outputs(changed, outputs())
    changed = outputs()
    changed[0].outputs[0].logprobs[1].token_id = 8
    with pytest.raises(AssertionError, match="token 8"):
        assert_same_outputs(changed, outputs())
    changed = outputs()
    changed[1].outputs[0].token_ids.append(5)
    with pytest.raises(AssertionError, match="tokens"):
        assert_same_outputs(changed, outputs())


@pytest.mark.parametrize("field, value", [("finish_reason", "length"), ("stop_reason", 9),
                                          ("text", "abd"), ("index", 2)])
def test_a_different_ending_or_text_fails(field, value):
    changed = outputs()
    setattr(changed[0].outputs[0], field, value)
    with pytest.raises(AssertionError):
        assert_same_outputs(changed, outputs())


def test_missing_outputs_or_logprobs_fail():
    with pytest.raises(AssertionError, match="outputs"):
        assert_same_outputs(outputs()[:1], outputs())
    changed = outputs()
    changed[0].outputs[0].logprobs = None
    with pytest.raises(AssertionError):
        assert_same_outputs(changed, outputs())
    changed = outputs()
    changed[0].outputs.pop()
    with pytest.raises(AssertionError, match="samples"):
        assert_same_outputs(changed, outputs())


def test_near_tied_top_ids_may_swap():
    changed = outputs()
    # 3 and 11 one 1e-6 apart: either order is float noise.
    changed[0].outputs[0].logprobs[1].top = [(9, -1.0), (3, -1.5), (11, -1.500001)]
    want = outputs()
    want[0].outputs[0].logprobs[1].top = [(9, -1.0), (11, -1.5), (3, -1.500001)]
    assert_same_outputs(changed, want)
    # The last place tied with a token the other run did not list: either may hold it.
    changed = outputs()
    changed[0].outputs[0].logprobs[1].top = [(9, -1.0), (3, -1.5), (20, -2.000001)]
    assert_same_outputs(changed, outputs())


def test_top_ids_that_are_not_tied_must_agree():
    changed = outputs()
    changed[0].outputs[0].logprobs[1].top = [(9, -1.0), (11, -1.5), (3, -2.0)]
    with pytest.raises(AssertionError, match="top token"):
        assert_same_outputs(changed, outputs())
    changed = outputs()
    changed[0].outputs[0].logprobs[1].top = [(9, -1.0), (3, -1.5), (20, -2.0 + 1e-2)]
    with pytest.raises(AssertionError):
        assert_same_outputs(changed, outputs())


def test_rank_must_agree_unless_tied():
    changed = outputs()
    changed[0].outputs[0].logprobs[0].rank = 2
    with pytest.raises(AssertionError, match="rank"):
        assert_same_outputs(changed, outputs())
    # The chosen token tied with the one above it: its rank may be either.
    tied = outputs()
    tied[0].outputs[0].logprobs[0].top = [(7, -0.5), (9, -0.5000001), (4, -3.0)]
    swapped = copy.deepcopy(tied)
    swapped[0].outputs[0].logprobs[0].top = [(9, -0.4999999), (7, -0.5), (4, -3.0)]
    swapped[0].outputs[0].logprobs[0].rank = 2
    assert_same_outputs(swapped, tied)

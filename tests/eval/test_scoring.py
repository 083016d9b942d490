"""Reading replies and scoring them: the exact format training teaches is what scores."""

from __future__ import annotations

import random

import pytest

from muse.chat_format import ASSISTANT_ID, END_OF_TURN_ID
from muse.eval.replies import read_reply
from muse.eval.schema import schema_errors
from muse.eval.tools import check_call
from muse.outputs import CompletionOutput
from muse.tokenizer import MuseTokenizer
from muse.train.data import arithmetic, tools
from muse.train.data.split import HELD_OUT


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def _completion(ids: list[int], finish_reason: str = "stop") -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None,
                            logprobs=None, finish_reason=finish_reason)


def _assistant_reply_ids(tokenizer: MuseTokenizer, messages: list[dict], tools_offered=None
                         ) -> list[int]:
    """The tokens of the last assistant turn, as a model trained on them would produce."""
    ids = tokenizer.apply_chat_template(messages, tools=tools_offered, tokenize=True)
    start = len(ids) - 1 - ids[::-1].index(ASSISTANT_ID)
    return ids[start + 1:ids.index(END_OF_TURN_ID, start) + 1]


def test_a_training_format_arithmetic_reply_scores_right(tokenizer: MuseTokenizer) -> None:
    problem = arithmetic.Problem("add", 37, 45)
    messages = arithmetic.exchange(problem, random.Random(0))
    reply = read_reply(_completion(_assistant_reply_ids(tokenizer, messages)), tokenizer)
    assert reply.think_well_formed and reply.ends_with_end_of_turn
    assert reply.reasoning == "7+5=12, write 2 carry 1. 3+4+1=8, write 8. So 82."
    assert reply.content == "82"


def test_a_training_format_tool_call_is_valid_and_correct(tokenizer: MuseTokenizer) -> None:
    rng = random.Random(1)
    for name in sorted(tools.MAKERS):
        case = tools.sample_case(rng, HELD_OUT, name)
        offered = tools.offered_tools(rng, name)
        messages = [{"role": "user", "content": case.request},
                    tools.call_message(case, offered)]
        reply = read_reply(_completion(_assistant_reply_ids(tokenizer, messages, offered)),
                           tokenizer)
        assert reply.content == "" and len(reply.tool_calls) == 1
        assert check_call(reply, offered, case) == (True, True)


def test_wrong_or_malformed_calls_are_told_apart(tokenizer: MuseTokenizer) -> None:
    case = tools.ToolCase("get_weather", "Weather in Oslo?", {"city": "Oslo"}, {}, "")
    offered = [tools.TOOL_SCHEMAS["get_weather"], tools.TOOL_SCHEMAS["get_time"]]

    def score(call_text: str) -> tuple[bool, bool]:
        ids = tokenizer.encode(f"<think>x</think><tool_call>{call_text}</tool_call><|end|>")
        return check_call(read_reply(_completion(ids), tokenizer), offered, case)

    assert score('{"name": "get_weather", "arguments": {"city": "Oslo"}}') == (True, True)
    assert score('{"name": "get_weather", "arguments": {"city": "Lima"}}') == (True, False)
    assert score('{"name": "get_time", "arguments": {"timezone": "Europe/Oslo"}}') == \
        (True, False)
    assert score('{"name": "get_weather", "arguments": {"unit": "kelvin"}}') == (False, False)
    assert score('{"name": "send_email", "arguments": {}}') == (False, False)
    assert score('{"name": "get_weather", "arguments": {"city": "Oslo"}') == (False, False)


@pytest.mark.parametrize("text, think_ok", [
    ("<think>a</think>b<|end|>", True),
    ("b<|end|>", False),
    ("<think>a</think><think>c</think>b<|end|>", False),
    ("x<think>a</think>b<|end|>", False),
    ("<think>a b<|end|>", False),
])
def test_think_block_must_be_one_and_first(tokenizer: MuseTokenizer, text: str,
                                           think_ok: bool) -> None:
    reply = read_reply(_completion(tokenizer.encode(text)), tokenizer)
    assert reply.think_well_formed == think_ok
    assert reply.ends_with_end_of_turn


def test_a_reply_cut_by_the_token_limit_does_not_end_its_turn(
        tokenizer: MuseTokenizer) -> None:
    reply = read_reply(_completion(tokenizer.encode("<think>a</think>12"), "length"), tokenizer)
    assert not reply.ends_with_end_of_turn and reply.content == "12"


def test_schema_errors_name_the_problem() -> None:
    schema = tools.TOOL_SCHEMAS["convert_currency"]["function"]["parameters"]
    assert schema_errors({"amount": 5, "from_currency": "USD", "to_currency": "EUR"}, schema) == []
    assert schema_errors({"amount": "5", "from_currency": "USD", "to_currency": "EUR"},
                         schema) == ["arguments.amount must be of type number, got str"]
    assert schema_errors({"amount": True, "from_currency": "USD", "to_currency": "EUR"},
                         schema)
    assert schema_errors({"amount": 5, "from_currency": "XYZ", "to_currency": "EUR"}, schema)
    assert schema_errors({"amount": 5}, schema) == [
        "arguments misses required `from_currency`", "arguments misses required `to_currency`"]
    closed = {"type": "object", "properties": {}, "additionalProperties": False}
    assert schema_errors({"extra": 1}, closed) == ["arguments has unknown property `extra`"]

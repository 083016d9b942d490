"""The synthetic conversations: deterministic, in the chat format, right answers, split apart."""

from __future__ import annotations

import json
import random
import re

import pytest

from muse.chat_format import ASSISTANT_ID, END_OF_TURN_ID, THINK_END_ID, THINK_START_ID
from muse.eval.schema import schema_errors
from muse.tokenizer import MuseTokenizer
from muse.train.data import arithmetic, instructions, tools
from muse.train.data.conversations import (TASK_NAMES, TEXT_TASKS, answered_directly,
                                           conversation_tasks, sample_conversation,
                                           tool_conversation)
from tests.train.helpers import NoiseSpeechPool
from muse.train.data.split import HELD_OUT, TRAIN, is_held_out


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def _conversations(seed: int, count: int, split: str = TRAIN):
    rng = random.Random(seed)
    return [sample_conversation(rng, split) for _ in range(count)]


def test_generators_are_deterministic_per_seed() -> None:
    first, again, other = _conversations(7, 50), _conversations(7, 50), _conversations(8, 50)
    assert first == again
    assert first != other


def test_every_task_appears() -> None:
    assert {c.task for c in _conversations(0, 200)} == {task.name for task in TEXT_TASKS}
    rng = random.Random(0)
    tasks = conversation_tasks(vision=True, speech_pool=NoiseSpeechPool())
    conversations = [sample_conversation(rng, TRAIN, tasks) for _ in range(200)]
    assert {c.task for c in conversations} == set(TASK_NAMES)
    for conversation in conversations:
        # One media item per placeholder part, of the part's kind.
        parts = [part["type"] for message in conversation.messages
                 if isinstance(message["content"], list) for part in message["content"]
                 if part["type"] != "text"]
        assert parts == [kind for kind, items in conversation.media.items() for _ in items]


def test_task_weights_replace_the_named_defaults() -> None:
    default = {task.name: task.weight
               for task in conversation_tasks(vision=True, speech_pool=NoiseSpeechPool())}
    tasks = conversation_tasks(vision=True, speech_pool=NoiseSpeechPool(),
                               weights={"unseen_tools": 0.0, "image": 2.0})
    weights = {task.name: task.weight for task in tasks}
    assert weights == {**default, "unseen_tools": 0.0, "image": 2.0}
    rng = random.Random(0)
    drawn = [sample_conversation(rng, TRAIN, tasks).task for _ in range(300)]
    assert "unseen_tools" not in drawn
    assert drawn.count("image") > drawn.count("video") * 5  # 2.0 against 0.1


@pytest.mark.parametrize("weights, message", [
    ({"unseen_tool": 1.0}, "unknown task"),
    ({"image": -1.0}, ">= 0"),
    ({"image": float("nan")}, ">= 0"),
    ({name: 0.0 for name in TASK_NAMES}, "all be zero"),
])
def test_bad_task_weights_are_refused(weights, message) -> None:
    with pytest.raises(ValueError, match=message):
        conversation_tasks(vision=True, speech_pool=NoiseSpeechPool(), weights=weights)


def test_conversations_render_and_round_trip(tokenizer: MuseTokenizer) -> None:
    for conversation in _conversations(1, 150):
        text = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools)
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == text
        assert text.startswith("<|bos|>")
        # Every assistant turn opens with one reasoning block and closes with <|end|>.
        starts = [i for i, token in enumerate(ids) if token == ASSISTANT_ID]
        assert starts
        for start in starts:
            end = ids.index(END_OF_TURN_ID, start)
            turn = ids[start + 1:end]
            assert turn[0] == THINK_START_ID
            assert turn.count(THINK_START_ID) == 1 and turn.count(THINK_END_ID) == 1
        if conversation.tools:
            assert "You can call the tools below" in text


def test_some_conversations_answer_with_thinking_off(tokenizer: MuseTokenizer) -> None:
    conversations = _conversations(2, 600)
    direct = [c for c in conversations
              if all(m.get("reasoning_content") == "" for m in c.messages
                     if m["role"] == "assistant")]
    # DIRECT_ANSWER_SHARE of 600: about 30, far from none and from all.
    assert 10 <= len(direct) <= 60, len(direct)
    conversation = direct[0]
    # The reply follows exactly what the generation prompt writes with thinking off.
    upto = conversation.messages.index(next(m for m in conversation.messages
                                            if m["role"] == "assistant"))
    prompt = tokenizer.apply_chat_template(conversation.messages[:upto],
                                           tools=conversation.tools,
                                           add_generation_prompt=True, enable_thinking=False)
    whole = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools)
    assert prompt.endswith("<|assistant|><think></think>") and whole.startswith(prompt)
    assert answered_directly(direct[0]).messages == direct[0].messages


def _equations_hold(reasoning: str) -> None:
    for left, right in re.findall(r"([\d+\-*]+)=(-?\d+)", reasoning):
        assert eval(left) == int(right), (left, right, reasoning)  # digits and + - * only


@pytest.mark.parametrize("operation", arithmetic.OPERATIONS)
def test_arithmetic_answers_and_steps_are_right(operation: str) -> None:
    rng = random.Random(3)
    symbol = {"add": "+", "sub": "-", "mul": "*"}[operation]
    for _ in range(300):
        problem = arithmetic.sample_problem(rng, TRAIN, operation)
        question, reply = arithmetic.exchange(problem, rng)
        # Recompute from the question as asked, not from the Problem object.
        numbers = [int(n) for n in re.findall(r"\d+", question["content"])]
        if "ubtract" in question["content"]:  # "Subtract b from a", "b subtracted from a"
            numbers.reverse()
        a, b = numbers
        expected = {"+": a + b, "-": a - b, "*": a * b}[symbol]
        assert reply["content"] == str(expected)
        assert reply["reasoning_content"].endswith(f"So {expected}.")
        _equations_hold(reply["reasoning_content"])


def test_worked_example_matches_the_documented_format() -> None:
    problem = arithmetic.Problem("add", 37, 45)
    assert arithmetic.worked_reasoning(problem) == \
        "7+5=12, write 2 carry 1. 3+4+1=8, write 8. So 82."
    assert arithmetic.worked_reasoning(arithmetic.Problem("sub", 37, 82)).endswith("So -45.")


def test_tool_calls_copy_the_request_and_fit_their_schema() -> None:
    rng = random.Random(4)
    for name in sorted(tools.MAKERS):
        for _ in range(40):
            case = tools.sample_case(rng, TRAIN, name)
            schema = tools.TOOL_SCHEMAS[name]["function"]["parameters"]
            assert schema_errors(case.arguments, schema) == []
            for value in case.arguments.values():
                if name == "get_time" and "timezone" not in case.request:
                    continue  # the city is asked for, the timezone looked up
                assert str(value) in case.request
            offered = tools.offered_tools(rng, name)
            user, call, result, answer = tools.exchange(case, offered)
            # The reasoning restates the request, lists the offered tools in order, then
            # names the one called.
            reasoning = call["reasoning_content"]
            assert reasoning.startswith(tools.asks(tools.REQUESTED_ACTIONS[name]) + " The tool")
            listed = [reasoning.index(f'"{schema["function"]["name"]}"') for schema in offered]
            assert listed == sorted(listed)
            assert reasoning.endswith(f'I should call "{name}".')
            assert json.loads(result["content"]) == case.result
            assert case.answer_value in answer["content"]
            assert call["tool_calls"][0]["function"]["name"] == name


def test_offered_tools_include_the_needed_one() -> None:
    rng = random.Random(5)
    for name in sorted(tools.MAKERS):
        offered = [schema["function"]["name"] for schema in tools.offered_tools(rng, name)]
        assert name in offered and 1 <= len(offered) <= 4 and len(set(offered)) == len(offered)


def test_a_request_whose_tool_is_not_offered_is_declined_after_reading_the_list() -> None:
    """`MISSING_SHARE` of tool conversations ask for a first-version tool (never the
    calculator) that is not offered: no call, the reasoning lists the offered tools as a call's
    does and then names the missing action, the reply declines it."""
    rng = random.Random(43)
    declined = 0
    for _ in range(400):
        conversation = tool_conversation(rng, TRAIN)
        first = next(m for m in conversation.messages if m["role"] == "assistant")
        offered = [schema["function"]["name"] for schema in conversation.tools]
        reasoning = first.get("reasoning_content", "")
        missing = next((name for name, action in tools.ACTIONS.items()
                        if reasoning.endswith((f" can {action}.", f" cannot {action}."))),
                       None)
        if first.get("tool_calls") or missing is None:
            continue  # a call, or a direct answer to a request that needs no tool
        declined += 1
        assert missing not in offered and missing != "add_numbers"
        assert reasoning.startswith(
            f"{tools.asks(tools.ACTIONS[missing])} {tools.offered_names(offered)}")
        assert tools.ACTIONS[missing] in first["content"]
    assert 25 <= declined <= 60, declined  # MISSING_SHARE of 400


def test_instruction_answers_are_right() -> None:
    rng = random.Random(6)
    for _ in range(200):
        case = instructions.sample_case(rng, TRAIN)
        listed = case.request.split(": ", 1)[-1].rstrip(".?")
        if case.request.startswith(("Sort these words", "Put in alphabetical", "Alphabetize")):
            assert case.answer == ", ".join(sorted(listed.split(", ")))
        elif case.request.startswith("Reverse this list"):
            assert case.answer == ", ".join(reversed(listed.split(", ")))
        elif case.request.startswith("How many items"):
            assert case.answer == str(len(listed.split(", ")))
        elif case.kind == "copy":
            assert case.request.endswith(case.answer)
        elif case.kind == "context":
            assert case.answer in case.request


@pytest.mark.parametrize("items", [2, 6, 9])
def test_sort_cases_hold_the_asked_number_of_items(items: int) -> None:
    rng = random.Random(4)
    for split in (TRAIN, HELD_OUT):
        for _ in range(20):
            case = instructions.sort_case(rng, split, items)
            listed = case.request.split(": ", 1)[-1].rstrip(".").split(", ")
            assert len(listed) == len(set(listed)) == items
            numbers = listed[0].isdigit()
            descending = "descending" in case.request
            expected = (sorted(listed, key=int, reverse=descending) if numbers
                        else sorted(listed))
            assert case.answer == ", ".join(expected)
            assert is_held_out(case.key) == (split == HELD_OUT)
    with pytest.raises(ValueError, match="2 to 50 items"):
        instructions.sort_case(rng, TRAIN, 51)


def test_train_and_held_out_never_overlap() -> None:
    rng = random.Random(9)
    for split in (TRAIN, HELD_OUT):
        for _ in range(100):
            assert is_held_out(arithmetic.sample_problem(rng, split).key) == (split == HELD_OUT)
            assert is_held_out(tools.sample_case(rng, split).key) == (split == HELD_OUT)
            assert is_held_out(instructions.sample_case(rng, split).key) == (split == HELD_OUT)


def test_training_renames_the_first_version_tools_arguments_in_schema_and_call() -> None:
    rng = random.Random(41)
    renamed = 0
    for _ in range(300):
        conversation = tool_conversation(rng, TRAIN)
        calls = [m for m in conversation.messages if m.get("tool_calls")]
        if not calls:
            continue
        function = calls[0]["tool_calls"][0]["function"]
        schema = next(s for s in conversation.tools if s["function"]["name"] == function["name"])
        assert schema_errors(function["arguments"], schema["function"]["parameters"]) == []
        original = tools.TOOL_SCHEMAS[function["name"]]["function"]["parameters"]["properties"]
        if set(function["arguments"]) - set(original):
            renamed += 1
            assert not set(schema["function"]["parameters"]["properties"]) & set(original)
    assert 40 <= renamed <= 120, renamed  # RENAMED_SHARE of the ~255 calls

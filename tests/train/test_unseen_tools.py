"""Made-up tools: deterministic, split apart, calls copied from the request and rendered."""

from __future__ import annotations

import json
import random

import pytest

from muse.eval.schema import schema_errors
from muse.tokenizer import MuseTokenizer
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, SPLITS, TRAIN, split_items
from muse.train.data.unseen_tools import KINDS, exchange, offered_schemas, sample_case, spoken


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def _cases(seed: int, count: int, split: str = TRAIN, kind: str | None = None):
    rng = random.Random(seed)
    return [sample_case(rng, split, kind) for _ in range(count)]


def test_cases_are_deterministic_per_seed() -> None:
    assert _cases(7, 60) == _cases(7, 60)
    assert _cases(7, 60) != _cases(8, 60)


@pytest.mark.parametrize("items", [
    unseen_tools.REQUEST_TEMPLATES, unseen_tools.ARGUMENT_TEMPLATES,
    unseen_tools.ANSWER_TEMPLATES, unseen_tools.DECLINE_TEMPLATES, unseen_tools.VERBS,
    unseen_tools.NOUNS, unseen_tools.QUALIFIERS, unseen_tools.ARGUMENT_WORDS])
def test_phrasings_and_vocabularies_split_into_two_nonempty_disjoint_parts(items) -> None:
    train, held_out = split_items(items, TRAIN), split_items(items, HELD_OUT)
    assert train and held_out and not set(train) & set(held_out)
    assert sorted(train + held_out) == sorted(items)


def test_every_kind_has_at_least_ten_phrasings() -> None:
    for templates in (unseen_tools.REQUEST_TEMPLATES, unseen_tools.ANSWER_TEMPLATES,
                      unseen_tools.DECLINE_TEMPLATES, unseen_tools.ARGUMENT_TEMPLATES):
        assert len(templates) >= 10


def test_held_out_tools_use_only_held_out_words() -> None:
    words = {split: {*split_items(unseen_tools.VERBS, split),
                     *split_items(unseen_tools.NOUNS, split),
                     *split_items(unseen_tools.QUALIFIERS, split)} for split in SPLITS}
    argument_words = {split: set(split_items(unseen_tools.ARGUMENT_WORDS, split))
                      for split in SPLITS}
    names = {}
    for split in SPLITS:
        cases = _cases(11, 200, split)
        tools = [tool for case in cases for tool in (case.requested, *case.offered)]
        for tool in tools:
            if split == HELD_OUT:
                assert set(tool.name.split("_")) <= words[split]
            # Training words are the training list's or made up, never held-out ones.
            assert not set(tool.name.split("_")) & words[HELD_OUT] - words[split]
            for argument in tool.arguments:
                word = argument.name.split("_")[-1]
                assert word in argument_words[split] or (
                    split == TRAIN and word not in argument_words[HELD_OUT])
        names[split] = {tool.name for tool in tools}
    assert not names[TRAIN] & names[HELD_OUT]


def test_training_names_are_mostly_made_up_so_they_must_be_copied() -> None:
    tools = [case.requested for case in _cases(5, 400, TRAIN)]
    listed = set(unseen_tools.VERBS) | {verb for verb, _ in unseen_tools.FAMILIAR_NAMES}
    made_up = [tool for tool in tools if tool.verb not in listed]
    assert 0.4 < len(made_up) / len(tools) < 0.75
    assert len({tool.verb for tool in made_up}) > 0.9 * len(made_up)
    familiar = {f"{verb}_{noun}" for verb, noun in unseen_tools.FAMILIAR_NAMES}
    assert any(tool.name in familiar for tool in tools)


def test_calls_copy_the_request_and_fit_the_offered_schema() -> None:
    for case in _cases(3, 300):
        assert case.arguments
        for value in case.arguments.values():
            assert spoken(value) in case.request, (value, case.request)
        assert case.requested.action in case.request
        schema = case.requested.schema()["function"]["parameters"]
        assert schema_errors(case.arguments, schema) == []
        names = [tool.name for tool in case.offered]
        assert len(set(names)) == len(names)
        actions = {(tool.verb, tool.noun) for tool in case.offered}
        assert len(actions) == len(names)
        if case.kind == "no_tool":
            assert (case.requested.verb, case.requested.noun) not in actions
            assert case.tool is None and case.result is None
        else:
            assert case.tool in case.offered
            assert len(case.offered) == 1 if case.kind == "call" else 2 <= len(case.offered) <= 4


def test_each_kind_gives_the_right_turns() -> None:
    for kind in KINDS:
        for case in _cases(5, 40, kind=kind):
            messages = exchange(case)
            assert messages[0] == {"role": "user", "content": case.request}
            if kind == "no_tool":
                assert len(messages) == 2 and "tool_calls" not in messages[1]
                assert case.requested.action in messages[1]["content"]
                continue
            user, call, result, answer = messages
            function = call["tool_calls"][0]["function"]
            assert function == {"name": case.requested.name, "arguments": case.arguments}
            assert json.loads(result["content"]) == case.result
            assert case.answer_value in answer["content"]


def test_rendered_chat_carries_the_schemas_and_the_call(tokenizer: MuseTokenizer) -> None:
    for case in _cases(9, 60) + _cases(9, 20, HELD_OUT):
        text = tokenizer.apply_chat_template(exchange(case), tools=offered_schemas(case))
        assert tokenizer.decode(tokenizer.encode(text)) == text
        assert "You can call the tools below" in text
        for schema in offered_schemas(case):
            assert json.dumps(schema) in text
        call = f'<tool_call>{{"name": "{case.requested.name}", "arguments": ' \
               f'{json.dumps(case.arguments)}}}</tool_call>'
        assert (call in text) == (case.kind != "no_tool")


def test_unknown_kind_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="call"):
        sample_case(random.Random(0), TRAIN, "guess")


def test_the_reasoning_repeats_the_request_before_naming_the_tool() -> None:
    rng = random.Random(21)
    for kind in KINDS:
        for _ in range(20):
            case = sample_case(rng, TRAIN, kind)
            user, reply = exchange(case)[:2]
            action = case.requested.action
            assert action in user["content"]
            assert reply["reasoning_content"].startswith(f"The user asks to {action}.")
            if case.tool is not None:
                assert reply["reasoning_content"].endswith(f"I should call {case.tool.name}.")


def test_training_names_are_spelled_with_every_letter_and_common_words() -> None:
    # A name word starting with a vowel ("_a", "_e" pieces) or holding "q" must have been
    # copied in training, or the model writes "bquarium" for "aquarium".
    tools = [tool for case in _cases(9, 600, TRAIN) for tool in case.offered]
    words = [word for tool in tools for word in (tool.verb, tool.noun)]
    assert {word[0] for word in words} >= set("abcdefghijklmnopqrstuvwxyz") - {"q", "x"}
    assert any("qu" in word for word in words)
    common = set(unseen_tools.common_words())
    assert 0.15 < sum(word in common for word in words) / len(words) < 0.5
    held_out = {word for items in (unseen_tools.VERBS, unseen_tools.NOUNS,
                                   unseen_tools.QUALIFIERS, unseen_tools.ARGUMENT_WORDS)
                for word in split_items(items, HELD_OUT)}
    assert not common & held_out

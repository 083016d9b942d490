"""Tools as users write them: values copied from the sentence, valid calls, split scenarios,
no overlapping tools offered together, and the users' tools section left unseen."""

from __future__ import annotations

import random
from collections import Counter

from muse.eval.tools import call_is_valid
from muse.eval.user_tools import TOOLS as USER_TOOLS
from muse.tokenizer import MuseTokenizer
from muse.train.data import conversations, natural_tools
from muse.train.data.natural_tools import SCENARIOS, sample_case, scenarios
from muse.train.data.split import HELD_OUT, TRAIN
from muse.train.data.unseen_tools import KINDS, exchange, offered_schemas, reasoning, spoken


def _cases(seed: int, count: int, split: str = TRAIN):
    rng = random.Random(seed)
    return [sample_case(rng, split) for _ in range(count)]


def _scenario_of(tool_name: str) -> natural_tools.Scenario:
    return next(scenario for scenario in SCENARIOS if tool_name in scenario.names)


def test_cases_are_deterministic_and_take_every_kind() -> None:
    assert _cases(3, 50) == _cases(3, 50)
    assert _cases(3, 50) != _cases(4, 50)
    kinds = Counter(case.kind for case in _cases(5, 600))
    assert set(kinds) == set(KINDS) and min(kinds.values()) > 60


def test_every_value_is_copied_from_the_request_into_a_valid_call() -> None:
    for split in (TRAIN, HELD_OUT):
        for case in _cases(11, 400, split):
            assert case.arguments and all(spoken(value) in case.request
                                          for value in case.arguments.values())
            schemas = offered_schemas(case)
            call = {"name": case.requested.name, "arguments": case.arguments}
            assert call_is_valid(call, [case.requested.schema()])
            if case.tool is None:
                assert case.requested.name not in {schema["function"]["name"]
                                                   for schema in schemas}
            else:
                assert call_is_valid(call, schemas)


def test_reasoning_restates_the_request_then_calls_or_declines() -> None:
    for case in _cases(12, 300):
        text = reasoning(case)
        assert text.startswith(case.restated)
        if case.tool is None:
            assert text.endswith((f"cannot {case.declined}.", f"can {case.declined}."))
            assert case.declined in case.answer
        else:
            assert text.endswith(f'I should call "{case.tool.name}".')
        # The restated words are the request's own (a question's thing is its own words too).
        restated = case.restated.removeprefix("The user asks to ").removeprefix(
            "The user asks for ").rstrip(".")
        for value in case.arguments.values():
            assert spoken(value) in restated


def test_held_out_scenarios_never_reach_training() -> None:
    held_out = {scenario.names[0] for scenario in scenarios(HELD_OUT)}
    train = {scenario.names[0] for scenario in scenarios(TRAIN)}
    assert held_out and train and not held_out & train
    assert held_out | train == {scenario.names[0] for scenario in SCENARIOS}
    held_out_names = {name for scenario in scenarios(HELD_OUT) for name in scenario.names}
    for case in _cases(13, 500):
        assert not {tool.name for tool in case.offered + (case.requested,)} & held_out_names


def test_overlapping_scenarios_are_never_offered_together() -> None:
    for case in _cases(14, 800):
        groups = [_scenario_of(tool.name).group for tool in case.offered + (
            () if case.tool else (case.requested,))]
        assert len(groups) == len(set(groups)), case


def test_users_tools_section_stays_unseen() -> None:
    """No scenario is a tool of `muse eval`'s users' tools, and no request is one of theirs."""
    names = {name for scenario in SCENARIOS for name in scenario.names}
    assert not names & set(USER_TOOLS)
    verbs_and_objects = {tuple(name.split("_")) for name in USER_TOOLS}
    assert not {tuple(name.split("_")) for name in names} & verbs_and_objects


def test_a_share_of_unseen_tool_conversations_are_natural(monkeypatch) -> None:
    rng = random.Random(15)
    names = {name for scenario in SCENARIOS for name in scenario.names}
    natural = sum(any(tool["function"]["name"] in names for tool in
                      conversations.unseen_tool_conversation(rng, TRAIN).tools)
                  for _ in range(400))
    assert 0.15 < natural / 400 < 0.35
    monkeypatch.setattr(conversations, "NATURAL_TOOL_SHARE", 0.0)
    assert not any(any(tool["function"]["name"] in names for tool in
                       conversations.unseen_tool_conversation(rng, TRAIN).tools)
                   for _ in range(200))


def test_cases_render_with_the_chat_template() -> None:
    tokenizer = MuseTokenizer.base()
    for case in _cases(16, 30):
        text = tokenizer.apply_chat_template(exchange(case), tools=offered_schemas(case))
        assert case.request in text and reasoning(case) in text


def test_the_number_of_offered_tools_does_not_tell_the_kind_in_training() -> None:
    """As for the generated tools: a training decline offers up to four tools, as a choice
    may; held-out declines keep one to three."""
    def counts(split: str, kind: str) -> set[int]:
        rng = random.Random(4)
        return {len(sample_case(rng, split, kind).offered) for _ in range(300)}
    assert counts(TRAIN, "choose") == {2, 3, 4}
    assert counts(TRAIN, "no_tool") == {1, 2, 3, 4}
    assert counts(HELD_OUT, "no_tool") == {1, 2, 3}

import random

from muse.train.data import name_lookup, unseen_tools
from muse.train.data.conversations import conversation_tasks, sample_conversation
from muse.train.data.split import HELD_OUT, TRAIN, split_items


def _cases(seed: int, count: int, split: str = TRAIN, kind: str | None = None):
    rng = random.Random(seed)
    return [name_lookup.sample_case(rng, split, kind) for _ in range(count)]


def test_a_prefix_lookup_finds_exactly_the_names_of_the_verb() -> None:
    cases = _cases(1, 300, kind="prefix")
    for case in cases:
        assert case.found == [name for name in case.names if name.startswith(case.key)]
        assert len(set(case.names)) == len(case.names) <= name_lookup.MOST_NAMES
    found = sum(bool(case.found) for case in cases) / len(cases)
    assert 0.4 < found < 0.9, found
    # Near misses: lists often hold a name of the same object and another verb.
    assert sum(any(name.endswith("_" + case.wanted.noun.replace(" ", "_")) and
                   not name.startswith(case.key) for name in case.names)
               for case in cases) > 60


def test_a_member_lookup_finds_the_whole_name_only() -> None:
    cases = _cases(2, 300, kind="member")
    for case in cases:
        assert case.found == ([case.wanted.name] if case.wanted.name in case.names else [])
    present = sum(bool(case.found) for case in cases) / len(cases)
    assert 0.35 < present < 0.65, present


def test_the_reasoning_is_the_unseen_tool_narrowing_sentence() -> None:
    for case in _cases(3, 200):
        offered = tuple(unseen_tools.Tool(name, name.split("_")[0], None, "x", "", (), "f")
                        for name in case.names)
        tool_case = unseen_tools.UnseenToolCase("no_tool", "", offered, case.wanted, {}, None, "")
        narrowed = unseen_tools.narrowed(tool_case)
        if case.kind == "prefix":
            assert narrowed.startswith(name_lookup.answer_sentence(case))
        elif case.found:
            assert name_lookup.answer_sentence(case) == f'"{case.wanted.name}" is among them.'


def test_exchange_answers_with_the_lookup() -> None:
    prefix = name_lookup.LookupCase("prefix", ("check_vault", "fetch_kiosk", "fetch_vault"),
                                    unseen_tools.Tool("fetch_vault", "fetch", None, "vault", "",
                                                      (), "f"), "Which are named {key}?")
    user, reply = name_lookup.exchange(prefix)
    assert user["content"] == ('Names: "check_vault", "fetch_kiosk" and "fetch_vault". '
                               'Which are named "fetch_..."?')
    assert reply["reasoning_content"] == \
        'Those named "fetch_...": "fetch_kiosk" and "fetch_vault".'
    assert reply["content"] == '"fetch_kiosk" and "fetch_vault".'
    member = name_lookup.LookupCase("member", ("check_vault",), prefix.wanted,
                                    "Is {name} among them?")
    user, reply = name_lookup.exchange(member)
    assert user["content"] == 'Name: "check_vault". Is "fetch_vault" among them?'
    assert (reply["reasoning_content"], reply["content"]) == (
        '"fetch_vault" is not among them.', "No.")


def test_held_out_lookups_use_held_out_questions_and_words() -> None:
    training = {case.question for case in _cases(4, 400)}
    held_out = _cases(5, 200, HELD_OUT)
    assert not training & {case.question for case in held_out}
    verbs = set(split_items(unseen_tools.VERBS, HELD_OUT))
    assert all(case.wanted.verb in verbs for case in held_out)


def test_the_task_is_drawn_only_when_weighted() -> None:
    rng = random.Random(6)
    default = conversation_tasks()
    assert not any(sample_conversation(rng, TRAIN, default).task == "name_lookup"
                   for _ in range(300))
    weighted = conversation_tasks(weights={"name_lookup": 1.0, "arithmetic": 0.0})
    tasks = {sample_conversation(rng, TRAIN, weighted).task for _ in range(200)}
    assert "name_lookup" in tasks

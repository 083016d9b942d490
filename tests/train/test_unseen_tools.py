"""Made-up tools: deterministic, split apart, calls copied from the request and rendered."""

from __future__ import annotations

import hashlib
import json
import random
import re

import pytest

from muse.eval.schema import schema_errors
from muse.eval.unseen_tools import held_out_cases
from muse.tokenizer import MuseTokenizer
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, SPLITS, TRAIN, split_items
from muse.train.data.unseen_tools import KINDS, exchange, offered_schemas, sample_case, spoken


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def _written(case: unseen_tools.UnseenToolCase) -> str:
    """The action as the request writes it: verbatim, or capitalized at its start."""
    action = case.requested.action
    return action if action in case.request else action[:1].upper() + action[1:]


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


def test_many_training_names_are_made_up_so_they_must_be_copied() -> None:
    tools = [case.requested for case in _cases(5, 400, TRAIN)]
    listed = set(unseen_tools.VERBS) | {verb for verb, _ in unseen_tools.FAMILIAR_NAMES}
    made_up = [tool for tool in tools if tool.verb not in listed]
    # The expected share is 0.40 (20,000 cases: lookups and familiar names take list verbs);
    # 400 cases draw it within about 0.025.
    assert 0.3 < len(made_up) / len(tools) < 0.55
    assert len({tool.verb for tool in made_up}) > 0.9 * len(made_up)
    familiar = {f"{verb}_{noun}" for verb, noun in unseen_tools.FAMILIAR_NAMES}
    assert any(tool.name in familiar for tool in tools)


def _action(tool: unseen_tools.Tool, case: unseen_tools.UnseenToolCase, split: str
            ) -> tuple[str | None, ...]:
    verb = "get" if case.lookup and tool.verb in unseen_tools.LOOKUP_VERBS else tool.verb
    qualified = split == TRAIN and sum(other.verb == tool.verb and other.noun == tool.noun
                                       for other in {*case.offered, case.requested}) > 1
    assert tool.qualifier or not qualified  # tools of one verb and noun, told apart
    return (verb, tool.noun, tool.qualifier if qualified else None)


@pytest.mark.parametrize("split", [TRAIN, HELD_OUT])
def test_calls_copy_the_request_and_fit_the_offered_schema(split: str) -> None:
    for case in _cases(3, 300, split):
        assert case.arguments
        for value in case.arguments.values():
            assert spoken(value) in case.request, (value, case.request)
        if case.lookup:  # asked as a question for the property of a thing
            assert all(word in case.request.lower() for word in case.requested.noun.split())
        else:
            written = _written(case)
            assert written in case.request
            assert written == case.requested.action or case.request.startswith(written)
        schema = case.requested.schema()["function"]["parameters"]
        assert schema_errors(case.arguments, schema) == []
        names = [tool.name for tool in case.offered]
        assert len(set(names)) == len(names)
        # One action a tool: a verb and a noun, or in training also the qualifier when two
        # tools of one verb and noun both have one.
        actions = {_action(tool, case, split) for tool in case.offered}
        assert len(actions) == len(names)
        if case.kind == "no_tool":
            assert _action(case.requested, case, split) not in actions
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


def test_the_reasoning_repeats_the_request_and_lists_the_offered_tools_before_deciding() -> None:
    rng = random.Random(21)
    for kind in KINDS:
        for _ in range(40):
            case = sample_case(rng, TRAIN, kind)
            user, reply = exchange(case)[:2]
            action = case.requested.action
            assert case.lookup or _written(case) in user["content"]
            names = [f'"{tool.name}"' for tool in case.offered]
            listed = f"The tool is {names[0]}." if len(names) == 1 else \
                f"The tools are {', '.join(names[:-1])} and {names[-1]}."
            decision = f'I should call "{case.tool.name}".' if case.tool is not None else \
                f"It cannot {action}." if len(names) == 1 else f"None of them can {action}."
            asked = f"for the {case.requested.noun}" if case.lookup else f"to {action}"
            assert reply["reasoning_content"] == \
                f"The user asks {asked}. {listed} {decision}"


def test_names_in_the_reasoning_are_the_schemas_and_the_calls_tokens() -> None:
    """A name quoted in the reasoning is the same run of tokens as in the tool schema and in
    the call, so copying it is copying tokens (unquoted, after a space, its first piece would
    be another token)."""
    tokenizer = MuseTokenizer.base()
    rng = random.Random(4)
    for _ in range(40):
        case = sample_case(rng, HELD_OUT, "call")
        rendered = tokenizer.apply_chat_template(exchange(case)[:2],
                                                 tools=offered_schemas(case))
        ids = tokenizer.encode(rendered)
        name = tokenizer.encode(f' "{case.tool.name}')
        starts = [i for i in range(len(ids)) if ids[i:i + len(name)] == name]
        # The schema, the list of offered tools, the decision and the call.
        assert len(starts) >= 4, (case.tool.name, rendered)


def test_training_near_misses_include_another_qualifier_of_the_same_verb_and_noun() -> None:
    """The choice must read every word of a name: training offers, beside a target with a
    qualifier, tools that differ from it only there; held-out cases never do."""
    misses = [(case, tool) for case in _cases(9, 600, TRAIN, "no_tool") for tool in case.offered
              if case.requested.qualifier and (tool.verb, tool.noun)
              == (case.requested.verb, case.requested.noun)]
    assert misses
    for case, tool in misses:
        assert tool.qualifier and tool.qualifier != case.requested.qualifier
    for case in _cases(9, 600, HELD_OUT):
        pairs = [(tool.verb, tool.noun) for tool in {*case.offered, case.requested}]
        assert len(set(pairs)) == len(pairs)


def test_training_distractors_share_the_targets_verb_more_often_than_held_out_ones() -> None:
    """A verdict that reads only the verb must be wrong often in training: nearly half the
    training distractors have the target's verb (the qualifier misses among them), against a
    quarter of held-out ones, which stay as they were."""
    def verb_share(split: str) -> float:
        pairs = [(case.requested, tool) for case in _cases(31, 600, split, "no_tool")
                 for tool in case.offered if not case.lookup]
        return sum(tool.verb == target.verb for target, tool in pairs) / len(pairs)

    assert 0.38 < verb_share(TRAIN) < 0.55
    assert 0.2 < verb_share(HELD_OUT) < 0.36


def test_training_distractors_often_take_the_targets_argument_names() -> None:
    """The action, not the arguments the user names, must pick the tool: about half the
    training distractors take some of the target's argument names or their relatives (the
    same word, another prefix), each name once a tool, its first argument still required,
    where without them almost none would."""
    distractors = [(case.requested, tool) for case in _cases(13, 600, TRAIN, "no_tool")
                   for tool in case.offered]
    same, relative = 0, 0
    for target, tool in distractors:
        names = [argument.name for argument in tool.arguments]
        assert len(set(names)) == len(names), tool
        assert tool.arguments[0].required, tool
        targets = {argument.name for argument in target.arguments}
        words = {unseen_tools.argument_word(name) for name in targets}
        same += bool(set(names) & targets)
        relative += any(name not in targets and unseen_tools.argument_word(name) in words
                        for name in names)
    assert 0.2 < same / len(distractors) < 0.5, same / len(distractors)
    assert 0.2 < relative / len(distractors) < 0.5, relative / len(distractors)


@pytest.mark.parametrize("name", ["budget", "max_budget", "start_new"])
def test_a_relative_name_keeps_the_word_and_changes_the_prefix(name: str) -> None:
    rng = random.Random(name)
    relatives = {unseen_tools.relative_name(rng, name, {name, "min_budget"})
                 for _ in range(200)}
    word = unseen_tools.argument_word(name)
    assert relatives == ({f"{prefix}_{word}" for prefix in unseen_tools.ARGUMENT_PREFIXES}
                         | ({word} if word != name else set())) - {name, "min_budget"}


def test_in_training_the_number_of_offered_tools_does_not_tell_the_kind() -> None:
    """Four offered tools were always a choice; a training decline offers up to four too
    (held-out declines keep one to three)."""
    def counts(split: str, kind: str) -> set[int]:
        return {len(case.offered) for case in _cases(5, 300, split, kind)}
    assert counts(TRAIN, "choose") == {2, 3, 4}
    assert counts(TRAIN, "no_tool") == {1, 2, 3, 4}
    assert counts(HELD_OUT, "no_tool") == {1, 2, 3}


def test_a_lookup_is_never_offered_beside_another_lookup_verb_of_its_noun() -> None:
    """"check_order_status" does what "get_order_status" does: as a distractor of a lookup it
    would make a declined request one that an offered tool fits."""
    lookups = [case for case in _cases(11, 6000, TRAIN, "no_tool") if case.lookup]
    assert len(lookups) > 1500  # ~4 such distractors expected without the rule
    for case in lookups:
        for tool in case.offered:
            assert not (tool.noun == case.requested.noun
                        and tool.verb in unseen_tools.LOOKUP_VERBS), (tool.name, case.request)


def test_composed_argument_phrases_hold_no_held_out_template_text() -> None:
    """Training argument phrases built from parts never write "a {name} of {value}" or
    "{name} = {value}", the held-out templates, and keep the name and the value verbatim."""
    for part in (*unseen_tools.ARGUMENT_DETERMINERS, *unseen_tools.ARGUMENT_LINKS,
                 *unseen_tools.ARGUMENT_PREPOSITIONS):
        assert not re.search(r"(^|\s)(a|of)(\s|$)|=", part), part
    rng = random.Random(13)
    phrases = {unseen_tools.composed_argument(rng, "max level", "7") for _ in range(400)}
    assert len(phrases) > 100
    for phrase in phrases:
        assert "max level" in phrase and re.search(r"(^|\s)7($|\s)", phrase), phrase
    requests = [case.request for case in _cases(12, 300) if not case.lookup]
    assert sum(any(link in request for link in (" should be ", " becomes ", " fixed at ",
                                                " matching ", " labelled "))
               for request in requests) > 10


def test_the_reasoning_of_hand_made_cases() -> None:
    first, second, wanted = (unseen_tools.random_tool(random.Random(seed), HELD_OUT)
                             for seed in (1, 2, 3))
    choose = unseen_tools.UnseenToolCase("choose", "", (first, second), second, {}, {}, "")
    assert unseen_tools.reasoning(choose) == (
        f'The user asks to {second.action}. The tools are "{first.name}" and "{second.name}". '
        f'I should call "{second.name}".')
    lone = unseen_tools.UnseenToolCase("no_tool", "", (first,), wanted, {}, None, "")
    assert unseen_tools.reasoning(lone) == (
        f'The user asks to {wanted.action}. The tool is "{first.name}". '
        f"It cannot {wanted.action}.")


# Held-out cases from before training requests were composed from parts: the evaluation's
# cases must not change when training phrasings do.
HELD_OUT_REQUESTS = {
    0: ("no_tool", "Go ahead and score the primary garden (budget = 633.33).",
        ["update_contract", "update_pending_garden", "fetch_license"]),
    1: ("call", "Go ahead and count the pending kiosk (batch = XGP-485 and count = 540.29).",
        ["count_pending_kiosk"]),
    2: ("no_tool", "Go ahead and check the remote vault (a channel of monthly and a batch of "
        "morning).", ["fetch_remote_voucher", "summarize_aquarium", "verify_vault"]),
}
HELD_OUT_DIGEST = "f0432ae18cc3a8bb22bccc82e50380b90647f98b0cefd2faa0dcb5c4fc57160a"
EVAL_CASES_DIGEST = "0ac622a4fcf12ce85a7e2abcdd0cfcfb0c08b2f0538450af43d76784bf16279f"


def _digest(cases) -> str:
    # Held-out cases are never lookups and their actions always say "the": without those
    # fields they read as before the fields existed.
    text = repr(cases).replace(", lookup=False, restated=None, declined=None)", ")").replace(
        ", determiner='the')", ")")
    return hashlib.sha256(text.encode()).hexdigest()


def test_held_out_cases_are_the_same_as_before_composed_requests() -> None:
    for seed, (kind, request, offered) in HELD_OUT_REQUESTS.items():
        case = sample_case(random.Random(seed), HELD_OUT)
        assert (case.kind, case.request, [tool.name for tool in case.offered]) == (
            kind, request, offered)
    assert _digest([sample_case(random.Random(seed), HELD_OUT) for seed in range(100)]) == \
        HELD_OUT_DIGEST
    assert _digest(held_out_cases(0, 60)) == EVAL_CASES_DIGEST


def test_training_requests_take_many_shapes() -> None:
    cases = [case for case in _cases(13, 2000) if not case.lookup]
    prefixes = {case.request[:case.request.index(_written(case))] for case in cases}
    assert len(prefixes) >= 150
    templated = sum(any(re.fullmatch(re.escape(template).replace(
        re.escape("{action}"), re.escape(case.requested.action)).replace(
        re.escape("{arguments}"), ".+"), case.request)
        for template in split_items(unseen_tools.REQUEST_TEMPLATES, TRAIN)) for case in cases)
    assert 0.35 < templated / len(cases) < 0.65


def _held_out_texts() -> list[tuple[str, str]]:
    """Each held-out template's text before `{action}` and between it and `{arguments}`."""
    texts = []
    for template in split_items(unseen_tools.REQUEST_TEMPLATES, HELD_OUT):
        before, after = template.split("{action}")
        texts.append((before.strip().lower(), after.split("{arguments}")[0]))
    return texts


def test_training_requests_hold_no_held_out_phrasing() -> None:
    texts = _held_out_texts()
    assert ("go ahead and", " (") in texts
    rng = random.Random(17)
    composed = [unseen_tools.composed_request(rng, "scan the locker", "code 5",
                                              may_lead=index % 2 == 0)
                for index in range(3000)]
    requests = [(case.request, _written(case)) for case in _cases(19, 2000)]
    for request, action in [*requests, *((text, "scan the locker") for text in composed)]:
        for before, after in texts:
            assert before not in request.lower(), request
            assert f"{action}{after}" not in request, request
    # Every part of a composed request is drawn in some request above.
    parts = unseen_tools.LEAD_INS + unseen_tools.QUESTION_LEAD_INS + unseen_tools.OPENERS
    assert all(any(part.split("{")[0].lower() in text.lower() for text in composed)
               for part in parts)


def test_some_lead_ins_are_words_training_never_uses_before_an_action(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Unknown words before the action ("trealon stick and scan the locker") teach where an
    action starts from its own shape; none holds a held-out template's words."""
    rng = random.Random(29)
    lead_ins = [unseen_tools.unknown_lead_in(rng) for _ in range(2000)]
    assert len(set(lead_ins)) > 1900
    held_out = [before for before, _ in _held_out_texts()]
    for lead_in in lead_ins:
        assert lead_in.endswith((" and", ",", " to")), lead_in
        assert not any(before in lead_in.lower() for before in held_out), lead_in
    drawn: list[str] = []
    original = unseen_tools.unknown_lead_in

    def recorded(rng: random.Random) -> str:
        drawn.append(original(rng))
        return drawn[-1]

    monkeypatch.setattr(unseen_tools, "unknown_lead_in", recorded)
    for _ in range(2000):
        count = len(drawn)
        request = unseen_tools.composed_request(rng, "scan the locker", "code 5")
        if len(drawn) > count:
            assert f"{drawn[-1]} scan the locker".lower() in request.lower(), request
    assert 0.04 < len(drawn) / 2000 < 0.25, len(drawn)


def test_composed_requests_keep_the_action_verbatim_and_the_arguments() -> None:
    rng = random.Random(23)
    for _ in range(500):
        request = unseen_tools.composed_request(rng, "zap the quorn", "a code of 7")
        assert "zap the quorn" in request and "a code of 7" in request
        assert request[-1] in ".?!" and "{" not in request
        assert "  " not in request


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


def test_training_also_asks_for_properties_of_things_with_the_argument_named_only_in_the_schema(
        ) -> None:
    cases = _cases(31, 600)
    lookups = [case for case in cases if case.lookup]
    # LOOKUP_SHARE of 600: about 180.
    assert 120 <= len(lookups) <= 240, len(lookups)
    for case in lookups:
        tool = case.requested
        noun, prop = tool.noun.split()
        assert tool.name.split("_")[0] in unseen_tools.LOOKUP_VERBS
        assert tool.name.endswith(f"_{noun}_{prop}")
        assert prop in case.request and noun.lower() in case.request.lower()
        (key, value), = case.arguments.items()
        assert value in case.request
        assert key in {form.format(noun=noun) for form in unseen_tools.KEY_NAMES}
        assert schema_errors(case.arguments, tool.schema()["function"]["parameters"]) == []
    assert not any(case.lookup for case in _cases(32, 200, split=HELD_OUT))


def test_pieced_words_are_strings_of_tokenizer_pieces() -> None:
    rng = random.Random(5)
    starts, insides = unseen_tools.word_pieces()
    assert len(starts) > 1000 and len(insides) > 2000 and "ailer" in insides
    for _ in range(200):
        word = unseen_tools.piece_word(rng)
        assert re.fullmatch(r"[a-z]{2,}", word)
        assert any(word.startswith(piece) and (word == piece or word[len(piece):] in insides)
                   for piece in (*starts, *insides))


def test_training_strings_include_ids_that_look_like_numbers_and_the_call_quotes_them(
        tokenizer: MuseTokenizer) -> None:
    rng = random.Random(7)
    ids = 0
    for _ in range(600):
        case = sample_case(rng, TRAIN, "call")
        for argument in case.requested.arguments:
            value = case.arguments.get(argument.name)
            if argument.type == "string" and value is not None and value[:1].isdigit():
                ids += 1
                assert value in case.request
                rendered = tokenizer.apply_chat_template(
                    exchange(case)[:2], tools=offered_schemas(case), tokenize=False)
                assert f'"{argument.name}": "{value}"' in rendered
    assert ids >= 20
    held_out = [sample_case(random.Random(seed), HELD_OUT, "call") for seed in range(300)]
    assert not any(isinstance(value, str) and value[:1].isdigit()
                   for case in held_out for value in case.arguments.values())

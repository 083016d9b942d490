from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse.cli import main
from muse.eval.replies import read_reply
from muse.eval.schema import schema_errors
from muse.eval.unseen_tools import MEASURES, score_reply
from muse.eval.user_tools import CASES, TOOLS, user_tool_cases
from muse.outputs import CompletionOutput
from muse.presets import SHIPPED_CHECKPOINT
from muse.tokenizer import MuseTokenizer
from muse.train.data.tools import ARGUMENT_SYNONYMS, TOOL_SCHEMAS
from muse.train.data.unseen_tools import offered_schemas


def _score(case, body: str) -> dict[str, bool]:
    tokenizer = MuseTokenizer.base()
    ids = tokenizer.encode(f"<think>x</think>{body}<|end|>")
    completion = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None,
                                  logprobs=None, finish_reason="stop")
    return score_reply(read_reply(completion, tokenizer), case)


def test_every_expected_call_fits_an_offered_schema_and_its_values_are_in_the_request() -> None:
    cases = user_tool_cases()
    assert {case.kind for case in cases} == {"call", "choose", "no_tool"}
    for case in cases:
        schemas = {s["function"]["name"]: s for s in offered_schemas(case)}
        if case.tool is None:
            assert case.arguments == {} and "unavailable" not in schemas
            continue
        schema = schemas[case.tool.name]["function"]["parameters"]
        assert schema_errors(case.arguments, schema) == []
        for value in case.arguments.values():
            assert str(value) in case.request


def test_the_expected_call_scores_right_and_the_first_versions_argument_name_does_not() -> None:
    weather = user_tool_cases()[0]
    assert weather.request == CASES[0][0] and weather.tool.name == "get_weather"
    # The first version's weather tool took `city`; these users call it `location`.
    assert "city" in TOOL_SCHEMAS["get_weather"]["function"]["parameters"]["properties"]
    call = {"name": "get_weather", "arguments": {"location": "Lisbon"}}
    assert _score(weather, f"<tool_call>{json.dumps(call)}</tool_call>")["right"]
    call["arguments"] = {"city": "Lisbon"}
    scores = _score(weather, f"<tool_call>{json.dumps(call)}</tool_call>")
    assert scores["right_tool"] and not scores["right_arguments"] and not scores["right"]
    declined = [case for case in user_tool_cases() if case.tool is None][0]
    assert _score(declined, "I can't do that.") == dict.fromkeys(MEASURES, True)
    assert not _score(declined, f"<tool_call>{json.dumps(call)}</tool_call>")["right"]


def test_training_never_gives_the_first_versions_tools_these_argument_names() -> None:
    for name in ("get_weather", "get_stock_price"):
        first = TOOL_SCHEMAS[name]["function"]["parameters"]["properties"]
        trained = {*first, *(other for key in first for other in ARGUMENT_SYNONYMS[key])}
        assert not {argument.name for argument in TOOLS[name].arguments} & trained


def test_the_tools_are_named_once() -> None:
    assert all(name == tool.name for name, tool in TOOLS.items())
    assert all(name in TOOLS for _, offered, _, _ in CASES for name in offered)


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
def test_muse_eval_runs_the_section(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", str(SHIPPED_CHECKPOINT), "--sections", "user_tools", "--device", "cpu",
          "--no-progress", "--json", str(out)])
    section = json.loads(out.read_text())["user_tools"]
    assert section["count"] == len(CASES)
    assert set(section["by_kind"]) == {"call", "choose", "no_tool"}
    assert "users' tools (22 hand-written cases)" in capsys.readouterr().out

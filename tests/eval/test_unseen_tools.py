"""The `unseen_tools` section: scoring hand-made replies, and a tiny run of the shipped model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from muse.cli import main
from muse.eval.replies import read_reply
from muse.eval.unseen_tools import (
    MEASURES,
    held_out_cases,
    same_value,
    score_reply,
    summarize,
)
from muse.outputs import CompletionOutput
from muse.presets import SHIPPED_CHECKPOINT
from muse.tokenizer import MuseTokenizer
from muse.train.data.unseen_tools import Argument, Tool, UnseenToolCase, sample_case


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def _tool(name: str, verb: str, noun: str, arguments: tuple[Argument, ...]) -> Tool:
    return Tool(name, verb, None, noun, f"{verb} the {noun}.", arguments, "status")


SCAN = _tool("scan_locker", "scan", "locker", (
    Argument("max_depth", "integer", "Depth.", True),
    Argument("zone", "enum", "Zone.", False, ("north", "south")),
    Argument("ratio", "number", "Ratio.", False),
    Argument("owner", "string", "Owner.", False)))
LOCK = _tool("lock_locker", "lock", "locker", (Argument("code", "string", "Code.", True),))
ARGUMENTS = {"max_depth": 12, "zone": "north", "ratio": 3.5, "owner": "Ana"}
CHOOSE = UnseenToolCase("choose", "Please scan the locker ...", (LOCK, SCAN), SCAN, ARGUMENTS,
                        {"status": "ok"}, "Done: the status is ok.")
NO_TOOL = UnseenToolCase("no_tool", "Please weigh the locker ...", (LOCK, SCAN),
                         _tool("weigh_locker", "weigh", "locker", SCAN.arguments), ARGUMENTS,
                         None, "I don't have a tool to weigh the locker.")


def _score(tokenizer: MuseTokenizer, case: UnseenToolCase, body: str) -> dict[str, bool]:
    ids = tokenizer.encode(f"<think>x</think>{body}<|end|>")
    completion = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None,
                                  logprobs=None, finish_reason="stop")
    return score_reply(read_reply(completion, tokenizer), case)


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _measures(valid: bool, tool: bool, arguments: bool, right: bool) -> dict[str, bool]:
    return dict(zip(MEASURES, (valid, tool, arguments, right)))


def test_the_right_call_scores_right(tokenizer: MuseTokenizer) -> None:
    assert _score(tokenizer, CHOOSE, _call("scan_locker", ARGUMENTS)) == _measures(
        True, True, True, True)
    # The same JSON values written differently: 3.50 is 3.5, key order does not matter.
    text = ('<tool_call>{"name": "scan_locker", "arguments": {"owner": "Ana", "ratio": 3.50, '
            '"zone": "north", "max_depth": 12}}</tool_call>')
    assert _score(tokenizer, CHOOSE, text)["right"]


def test_a_wrong_argument_name_is_the_right_tool_with_wrong_arguments(
        tokenizer: MuseTokenizer) -> None:
    renamed = {**{k: v for k, v in ARGUMENTS.items() if k != "owner"}, "user": "Ana"}
    # An unknown optional name still fits the schema (it does not forbid extra properties).
    assert _score(tokenizer, CHOOSE, _call("scan_locker", renamed)) == _measures(
        True, True, False, False)
    # A training-style name in place of the required argument does not.
    wrong = {"depth": 12, "zone": "north", "ratio": 3.5, "owner": "Ana"}
    assert _score(tokenizer, CHOOSE, _call("scan_locker", wrong)) == _measures(
        False, True, False, False)
    missing = {"max_depth": 12, "zone": "north", "ratio": 3.5}
    assert _score(tokenizer, CHOOSE, _call("scan_locker", missing)) == _measures(
        True, True, False, False)


def test_a_made_up_value_or_the_wrong_tool_is_not_right(tokenizer: MuseTokenizer) -> None:
    assert _score(tokenizer, CHOOSE, _call("scan_locker", {**ARGUMENTS, "owner": "Ben"})) == \
        _measures(True, True, False, False)
    assert _score(tokenizer, CHOOSE, _call("scan_locker", {**ARGUMENTS, "max_depth": "12"})) \
        == _measures(False, True, False, False)
    assert _score(tokenizer, CHOOSE, _call("lock_locker", {"code": "AB-12"})) == _measures(
        True, False, False, False)
    assert _score(tokenizer, CHOOSE, _call("open_locker", ARGUMENTS)) == _measures(
        False, False, False, False)
    assert _score(tokenizer, CHOOSE, "I scanned it.") == _measures(False, False, False, False)
    two = _call("scan_locker", ARGUMENTS) * 2
    assert _score(tokenizer, CHOOSE, two) == _measures(False, False, False, False)


def test_a_call_when_no_tool_fits_is_wrong(tokenizer: MuseTokenizer) -> None:
    assert _score(tokenizer, NO_TOOL, "I don't have a tool to weigh the locker.") == _measures(
        True, True, True, True)
    assert _score(tokenizer, NO_TOOL, _call("scan_locker", ARGUMENTS)) == _measures(
        False, False, False, False)
    assert _score(tokenizer, NO_TOOL, "<tool_call>{oops</tool_call>") == _measures(
        False, False, False, False)


def test_a_reply_cut_off_by_its_budget_has_not_declined(tokenizer: MuseTokenizer) -> None:
    ids = tokenizer.encode("<think>The user asks to weigh the locker. The tools are")
    completion = CompletionOutput(index=0, text="", token_ids=ids, cumulative_logprob=None,
                                  logprobs=None, finish_reason="length")
    assert score_reply(read_reply(completion, tokenizer), NO_TOOL) == _measures(
        False, False, False, False)


def test_malformed_json_is_not_valid(tokenizer: MuseTokenizer) -> None:
    text = _call("scan_locker", ARGUMENTS)[:-len("}</tool_call>")] + "</tool_call>"
    assert _score(tokenizer, CHOOSE, text) == _measures(False, False, False, False)
    assert _score(tokenizer, CHOOSE, "<tool_call>[1, 2]</tool_call>") == _measures(
        False, False, False, False)
    extra = ('<tool_call>{"name": "scan_locker", "arguments": {"max_depth": 12, "zone": '
             '"north", "ratio": 3.5, "owner": "Ana"}, "id": 1}</tool_call>')
    assert _score(tokenizer, CHOOSE, extra) == _measures(False, True, True, False)


@pytest.mark.parametrize("value, expected, kind, same", [
    ("Ana", "Ana", "string", True), ("ana", "Ana", "string", False),
    (" Ana", "Ana", "string", False), ("north", "north", "enum", True),
    (12, 12, "integer", True), (12.0, 12, "integer", False), ("12", 12, "integer", False),
    (True, 1, "integer", False), (3.5, 3.5, "number", True), (4, 4.0, "number", True),
    (3.51, 3.5, "number", False), (True, True, "boolean", True), (1, True, "boolean", False),
    ("true", True, "boolean", False)])
def test_values_compare_as_json_values_of_the_schema_type(value, expected, kind, same) -> None:
    assert same_value(value, expected, kind) is same


def test_cases_are_held_out_seeded_and_spread_over_kinds() -> None:
    cases = held_out_cases(seed=1, num=6)
    assert cases == held_out_cases(seed=1, num=6) != held_out_cases(seed=2, num=6)
    assert [case.kind for case in cases] == ["call", "choose", "no_tool"] * 2
    rng = random.Random(0)
    train_names = {sample_case(rng, "train").requested.name for _ in range(200)}
    assert not {tool.name for case in cases for tool in case.offered} & train_names


def test_summary_is_per_kind_and_overall() -> None:
    scores = [_measures(True, True, True, True), _measures(True, True, False, False),
              _measures(False, False, False, False)]
    summary = summarize([CHOOSE, CHOOSE, NO_TOOL], scores)
    assert summary["count"] == 3 and summary["valid"] == pytest.approx(2 / 3)
    assert summary["right"] == pytest.approx(1 / 3)
    assert summary["by_kind"] == {
        "choose": {"count": 2, "valid": 1.0, "right_tool": 1.0, "right_arguments": 0.5,
                   "right": 0.5},
        "no_tool": {"count": 1, "valid": 0.0, "right_tool": 0.0, "right_arguments": 0.0,
                    "right": 0.0}}


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
def test_a_tiny_run_on_the_shipped_model_writes_the_figures(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", str(SHIPPED_CHECKPOINT), "--sections", "unseen_tools", "--num", "2",
          "--device", "cpu", "--no-progress", "--json", str(out)])
    report = json.loads(out.read_text())
    section = report["unseen_tools"]
    assert section["count"] == 2 and set(section["by_kind"]) == {"call", "choose"}
    for cell in (section, *section["by_kind"].values()):
        assert all(0.0 <= cell[measure] <= 1.0 for measure in MEASURES)
    assert report["replies"]["count"] == 2 and report["examples"]["unseen_tools"]
    assert "tools" not in report and "arithmetic" not in report
    printed = capsys.readouterr().out
    assert "unseen tools (2 held-out cases)" in printed and "acceptance bars:" in printed

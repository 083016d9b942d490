"""scripts/unseen_tool_decisions.py: the calling-or-declining decision read teacher-forced."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import replace

import pytest

from muse.presets import SHIPPED_CHECKPOINT
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, TRAIN
from tests.train.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("unseen_tool_decisions")


@pytest.mark.parametrize("split", [TRAIN, HELD_OUT])
def test_the_prefix_is_the_reasoning_up_to_its_decision(script, split) -> None:
    rng = random.Random(4)
    for kind in unseen_tools.KINDS * 10:
        case = unseen_tools.sample_case(rng, split, kind)
        text, prefix = unseen_tools.reasoning(case), script.decision_prefix(case)
        rest = text[len(prefix):]
        assert text.startswith(prefix)
        if kind == "no_tool":
            assert rest.startswith((" It cannot ", " None of them can ")), rest
        else:
            assert rest == f' I should call "{case.tool.name}".'


def _with_argument_names(tool: unseen_tools.Tool, names: list[str]) -> unseen_tools.Tool:
    return replace(tool, arguments=tuple(replace(argument, name=name)
                                         for argument, name in zip(tool.arguments, names)))


def test_the_overlap_is_read_only_from_tools_that_do_not_fit(script) -> None:
    case = unseen_tools.sample_case(random.Random(2), HELD_OUT, "choose")
    asked = next(iter(case.arguments))
    word = unseen_tools.argument_word(asked)
    others = [tool for tool in case.offered if tool is not case.tool]
    apart = [_with_argument_names(tool, [f"zz{index}q" for index in range(3)])
             for tool in others]

    def overlap(*names: str) -> str:
        near = _with_argument_names(apart[0], [*names, "zzq"])
        return script.argument_overlap(replace(case, offered=(case.tool, near, *apart[1:])))

    # The fitting tool always takes the request's arguments: that is no overlap.
    assert script.argument_overlap(replace(case, offered=(case.tool, *apart))) == "none"
    assert overlap(asked) == "same name"
    assert overlap(f"{'min' if asked.startswith('max_') else 'max'}_{word}") == "same word"
    assert overlap("zzr") == "none"


def test_a_shared_prefix_alone_is_its_own_group(script) -> None:
    case = unseen_tools.sample_case(random.Random(3), HELD_OUT, "no_tool")
    value = next(iter(case.arguments.values()))
    case = replace(case, requested=_with_argument_names(case.requested, ["max_zzbudget"]),
                   arguments={"max_zzbudget": value},
                   offered=tuple(_with_argument_names(tool, ["max_zzdepth", "zzq", "zzr"])
                                 for tool in case.offered))
    assert script.argument_overlap(case) == "prefix only"


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="needs the shipped checkpoint")
def test_the_script_reads_decisions_and_writes_json(script, monkeypatch, tmp_path) -> None:
    out = tmp_path / "decisions.json"
    monkeypatch.setattr(sys, "argv", ["unseen_tool_decisions.py", str(SHIPPED_CHECKPOINT),
                                      "--num", "6", "--json", str(out)])
    script.main()
    result = json.loads(out.read_text())["decisions"]
    assert {key for key in result if key.endswith(", all")} == {
        f"{kind}, all" for kind in unseen_tools.KINDS}
    for kind in unseen_tools.KINDS:
        counts = {key: cell["count"] for key, cell in result.items() if key.startswith(kind)}
        by_offered = [count for key, count in counts.items() if key.endswith(" offered")]
        by_overlap = [count for key, count in counts.items()
                      if not key.endswith((" offered", ", all"))]
        assert sum(by_offered) == sum(by_overlap) == counts[f"{kind}, all"] == 2
    assert all(0.0 <= cell["right"] <= 1.0 for cell in result.values())

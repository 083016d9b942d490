"""The users'-kind-of-tools section: held-out scenarios only, the kinds in turn, run by
`muse eval`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse.cli import main
from muse.eval.natural_tools import held_out_natural_cases
from muse.presets import SHIPPED_CHECKPOINT
from muse.train.data.natural_tools import scenarios
from muse.train.data.split import HELD_OUT
from muse.train.data.unseen_tools import KINDS


def test_cases_come_from_held_out_scenarios_in_turn() -> None:
    cases = held_out_natural_cases(1, 60)
    assert cases == held_out_natural_cases(1, 60) != held_out_natural_cases(2, 60)
    assert [case.kind for case in cases] == [KINDS[index % 3] for index in range(60)]
    held_out = {name for scenario in scenarios(HELD_OUT) for name in scenario.names}
    assert all(case.requested.name in held_out for case in cases)
    assert len({case.requested.name for case in cases}) > 10


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
def test_muse_eval_runs_the_section(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", str(SHIPPED_CHECKPOINT), "--sections", "natural_tools", "--num", "6",
          "--device", "cpu", "--no-progress", "--json", str(out)])
    section = json.loads(out.read_text())["natural_tools"]
    assert section["count"] == 6 and set(section["by_kind"]) == set(KINDS)
    assert "natural tools (6 held-out cases)" in capsys.readouterr().out

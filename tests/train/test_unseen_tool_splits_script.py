"""scripts/unseen_tool_splits.py: unseen-tool cases of both splits, scored as `muse eval`."""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from muse.presets import SHIPPED_CHECKPOINT
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, TRAIN
from tests.train.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("unseen_tool_splits")


def test_each_split_gives_its_own_cases_the_kinds_in_turn(script) -> None:
    train, held_out = script.split_cases(TRAIN, 9), script.split_cases(HELD_OUT, 9)
    assert [case.kind for case in train] == list(unseen_tools.KINDS) * 3
    assert [case.kind for case in held_out] == list(unseen_tools.KINDS) * 3
    assert script.split_cases(TRAIN, 9) == train  # seeded
    held_out_words = unseen_tools._held_out_words()
    for case in held_out:
        assert set(case.requested.name.split("_")) <= held_out_words
    for case in train:
        assert not set(case.requested.name.split("_")) & held_out_words


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="needs the shipped checkpoint")
def test_the_script_scores_both_splits_and_writes_json(script, monkeypatch, tmp_path) -> None:
    out = tmp_path / "splits.json"
    monkeypatch.setattr(sys, "argv", ["unseen_tool_splits.py", str(SHIPPED_CHECKPOINT),
                                      "--num", "3", "--splits", "held_out,train",
                                      "--json", str(out)])
    script.main()
    scored, = json.loads(out.read_text())["models"]
    for split in (TRAIN, HELD_OUT):
        assert scored[split]["count"] == 3
        assert set(scored[split]["by_kind"]) == set(unseen_tools.KINDS)
        assert 0.0 <= scored[split]["right"] <= 1.0


def test_splits_names_train_and_held_out_only(script) -> None:
    assert script._splits("held_out") == (HELD_OUT,)
    assert script._splits("train, held_out") == (TRAIN, HELD_OUT)
    with pytest.raises(argparse.ArgumentTypeError):
        script._splits("held_out,test")

"""`muse eval` end to end on a tiny random checkpoint, through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse.cli import main
from muse.eval.options import EvalSettings
from muse.eval.run import (
    ACCEPTANCE_BARS,
    check_model,
    evaluate,
    failed_bars,
    format_table,
    metric,
)
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset

SMALL = ["--num", "2", "--max-tokens", "6", "--max-digits", "2", "--python-files", "2",
         "--python-tokens", "32", "--unigram-chars", "20000", "--no-python-packages",
         "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_random_checkpoint(get_preset("muse-spark-tiny"),
                                  tmp_path_factory.mktemp("tiny"), seed=0)


def test_eval_writes_every_figure(checkpoint: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", str(checkpoint), *SMALL, "--json", str(out)])
    report = json.loads(out.read_text())
    for operation in ("add", "sub", "mul"):
        for digits in ("1", "2"):
            cell = report["arithmetic"][operation][digits]
            assert cell["count"] >= 1 and 0.0 <= cell["exact"] <= 1.0
    assert {"count", "valid", "correct", "answer_uses_result", "by_tool"} <= set(report["tools"])
    assert set(report["instructions"]) == {"sort", "reverse", "count", "copy", "context"}
    assert {"count", "ends_with_end_of_turn", "think_well_formed"} <= set(report["replies"])
    python = report["python"]
    assert python["files"] == 2 and python["tokens"] > 0
    assert python["model_loss"] > 0 and python["unigram_loss"] > 0
    assert "command" in report and report["settings"]["num"] == 2
    printed = capsys.readouterr().out
    assert "arithmetic, exact match" in printed and "acceptance bars:" in printed


def test_eval_scores_with_the_storage_flags(checkpoint: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", str(checkpoint), *SMALL, "--sections", "arithmetic", "--kv-cache-dtype", "fp8",
          "--calculate-kv-scales", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["engine_args"]["kv_cache_dtype"] == "fp8"
    assert report["engine_args"]["calculate_kv_scales"] is True
    assert report["arithmetic"]["overall"]["count"] > 0
    assert "KV cache fp8" in capsys.readouterr().out


def test_sorting_section_reports_every_list_length(checkpoint: Path) -> None:
    report = evaluate(str(checkpoint), EvalSettings(num=2, max_tokens=6, sections=("sorting",)),
                      device="cpu")
    assert set(report["sorting"]) == {"3", "4", "5", "6", "7", "8", "overall"}
    assert all(report["sorting"][items]["count"] == 2 for items in "345678")
    assert report["sorting"]["overall"]["count"] == 12
    assert "sorting, exact match" in format_table(report)


def test_random_weights_fail_the_acceptance_bars(checkpoint: Path) -> None:
    settings = EvalSettings(num=2, max_tokens=6, max_digits=2, sections=("arithmetic", "tools"))
    report = evaluate(str(checkpoint), settings, device="cpu")
    failures = failed_bars(report, ACCEPTANCE_BARS)
    assert any(f.startswith("tools.valid") for f in failures)
    assert metric(report, "arithmetic.add.2.exact") is not None
    assert metric(report, "python.model_loss") is None
    assert failed_bars(report, {"python.model_loss": 0.0}) == ["python.model_loss is not in "
                                                                "the report"]
    assert "tool calls" in format_table(report)


def test_unknown_sections_are_refused(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="sections"):
        evaluate(str(checkpoint), EvalSettings(sections=("poetry",)), device="cpu")


def test_check_model_lists_the_missed_bars(checkpoint: Path) -> None:
    bars = {"arithmetic.add.2.exact": 0.5, "replies.ends_with_end_of_turn": 0.0}
    assert check_model(str(checkpoint), bars, num=1, sections=("arithmetic",)) == [
        "arithmetic.add.2.exact = 0.000 < 0.5"]

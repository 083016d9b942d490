"""The `vision`, `video` and `audio` sections: scoring, held-out cases, and tiny end-to-end
runs on the random `muse-spark-tiny` preset (accuracy about 0; the report's shape is checked)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from muse.cli import main
from muse.eval import media_tasks
from muse.eval.media_tasks import MEDIA_BARS, held_out_cases, is_right, normalize, summarize
from muse.eval.options import EvalSettings
from muse.eval.run import ACCEPTANCE_BARS, evaluate, failed_bars
from muse.train.data import speech, vision_tasks
from muse.train.data.split import HELD_OUT, split_items

ENGINE = {"device": "cpu", "kv_cache_memory_bytes": 32 * 2**20}
needs_espeak = pytest.mark.skipif(speech.find_espeak() is None, reason="espeak-ng not found")


@pytest.mark.parametrize("reply, answer, right", [
    ("red", "red", True), (" Red. ", "red", True), ("TOP LEFT.", "top left", True),
    ("42", "42", True), ("42.", "42", True), ("42..", "42", False), ("4 2", "42", False),
    ("red circle", "red", False), ("", "0", False)])
def test_exact_match_ignores_case_spaces_and_one_period(reply: str, answer: str,
                                                        right: bool) -> None:
    assert is_right(reply, answer) is right
    assert normalize(" Blue. ") == "blue"


def test_cases_are_held_out_seeded_and_spread_over_kinds() -> None:
    cases = held_out_cases("vision", seed=1, num=2)
    assert [case.kind for case in cases] == list(vision_tasks.IMAGE_KINDS) * 2
    again = held_out_cases("vision", seed=1, num=2)
    assert [c.messages for c in cases] == [c.messages for c in again]
    assert [c.messages for c in cases] != [c.messages for c in held_out_cases("vision", 2, 2)]
    assert all(np.array_equal(np.asarray(a.media), np.asarray(b.media))
               for a, b in zip(cases, again))
    videos = held_out_cases("video", seed=1, num=1)
    assert [case.kind for case in videos] == list(vision_tasks.VIDEO_KINDS)
    for case in videos:
        assert case.question in split_items(vision_tasks.VIDEO_QUESTIONS[case.kind], HELD_OUT)
        assert case.media.dtype == np.uint8 and case.media.ndim == 4
        assert case.messages[1]["content"] == case.answer


def test_audio_cases_use_held_out_voices(monkeypatch: pytest.MonkeyPatch) -> None:
    real = speech.sample_audio_case

    def silent(rng: random.Random, split: str, kind: str | None = None):
        return real(rng, split, kind, synth=lambda text, voice: np.zeros(4800, np.float32))

    monkeypatch.setattr(speech, "sample_audio_case", silent)
    cases = held_out_cases("audio", seed=1, num=3)
    assert [case.kind for case in cases] == list(speech.KINDS) * 3
    for case in cases:
        assert case.question in speech.questions(HELD_OUT, case.kind) and case.question
        assert "in voice" in case.note and case.media.dtype == np.float32
    assert not any(" -s 175 -p 50 " in case.note for case in cases)


def test_summary_is_per_kind_and_overall() -> None:
    cases = held_out_cases("video", seed=1, num=2)
    right = [True, False, False, True, False, False]
    summary = summarize("video", cases, right)
    assert summary["count"] == 6 and summary["exact"] == pytest.approx(2 / 6)
    assert summary["by_kind"] == {"direction": {"count": 2, "exact": 1.0},
                                  "shape": {"count": 2, "exact": 0.0},
                                  "colour": {"count": 2, "exact": 0.0}}


def test_the_bars_are_acceptance_bars() -> None:
    assert MEDIA_BARS == {"vision.by_kind.colour.exact": 0.90, "vision.by_kind.shape.exact": 0.90,
                          "vision.by_kind.count.exact": 0.80,
                          "video.by_kind.direction.exact": 0.80,
                          "audio.by_kind.number.exact": 0.90}
    assert MEDIA_BARS.items() <= ACCEPTANCE_BARS.items()


def test_sections_are_opt_in_and_checked() -> None:
    assert not {"vision", "video", "audio"} & set(EvalSettings().sections)
    with pytest.raises(ValueError, match="section"):
        media_tasks.check_section("pictures")


def test_audio_without_espeak_fails_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speech, "find_espeak", lambda: None)
    with pytest.raises(RuntimeError, match="espeak-ng"):
        evaluate("no-such-model", EvalSettings(num=1, sections=("audio",)), device="cpu")


def _check_section(report: dict, section: str, kinds: tuple[str, ...], num: int) -> None:
    cells = report[section]
    assert cells["count"] == num * len(kinds) and 0.0 <= cells["exact"] <= 1.0
    assert list(cells["by_kind"]) == list(kinds)
    assert all(cell["count"] == num for cell in cells["by_kind"].values())
    shown = report["examples"][section]
    assert {example["kind"] for example in shown} == set(kinds)
    assert all({"question", "reply", "expected", "ok"} <= set(example) for example in shown)


def test_vision_and_video_run_end_to_end_on_the_tiny_preset() -> None:
    settings = EvalSettings(num=1, sections=("vision", "video"), max_tokens=8)
    report = evaluate("muse-spark-tiny", settings, progress=False, **ENGINE)
    _check_section(report, "vision", vision_tasks.IMAGE_KINDS, 1)
    _check_section(report, "video", vision_tasks.VIDEO_KINDS, 1)
    assert report["replies"]["count"] == 8 and "audio" not in report
    # A random model misses every bar it is measured on; audio was not run.
    failures = failed_bars(report, MEDIA_BARS)
    assert {failure.split(" ")[0] for failure in failures} == set(MEDIA_BARS)
    assert "audio.by_kind.number.exact is not in the report" in failures


@needs_espeak
def test_audio_runs_end_to_end_through_the_cli(tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "eval.json"
    main(["eval", "muse-spark-tiny", "--sections", "audio", "--num", "1", "--max-tokens", "8",
          "--device", "cpu", "--no-progress", "--json", str(out)])
    report = json.loads(out.read_text())
    _check_section(report, "audio", speech.KINDS, 1)
    assert all("in voice" in example["media"] for example in report["examples"]["audio"])
    assert report["replies"]["count"] == 3 and "vision" not in report
    printed = capsys.readouterr().out
    assert "audio (3 held-out cases), exact match (count)" in printed
    assert "audio.by_kind.number.exact" in printed  # the bar is checked (and missed)

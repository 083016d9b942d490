"""`muse eval`'s progress bars: on a terminal by default, in a log only with --progress."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from muse.cli import main
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset

QUICK = ["--sections", "arithmetic,python", "--num", "1", "--max-digits", "1", "--max-tokens",
         "4", "--python-files", "1", "--python-tokens", "16", "--unigram-chars", "2000",
         "--no-python-packages", "--device", "cpu"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_random_checkpoint(get_preset("muse-spark-tiny"),
                                  tmp_path_factory.mktemp("tiny"), seed=0)


def bars_written(checkpoint: Path, monkeypatch: pytest.MonkeyPatch, stderr: io.StringIO,
                 *flags: str) -> str:
    monkeypatch.setattr(sys, "stderr", stderr)
    main(["eval", str(checkpoint), *QUICK, *flags])
    return stderr.getvalue()


def test_a_terminal_shows_a_bar_per_section(checkpoint: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    written = bars_written(checkpoint, monkeypatch, Terminal())
    assert "arithmetic: 100%" in written and "python loss: 100%" in written


def test_a_log_gets_no_bar_unless_asked(checkpoint: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert "100%" not in bars_written(checkpoint, monkeypatch, io.StringIO())
    assert "arithmetic: 100%" in bars_written(checkpoint, monkeypatch, io.StringIO(),
                                              "--progress")
    assert "100%" not in bars_written(checkpoint, monkeypatch, Terminal(), "--no-progress")

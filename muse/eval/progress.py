"""Progress bars of `muse eval`, as vLLM and lm-eval users know them: one per batch of
generation, on stderr when it is a terminal, in a log only when asked for."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from muse.llm import ProgressOption

# A forced bar in a log file redraws as a new line each time: keep those few.
LOG_REFRESH_S = 10.0


def progress_bars(progress: bool | None, label: str) -> ProgressOption:
    """`use_tqdm` for `LLM.generate`: bars labelled `label`; with progress None only when
    stderr is a terminal, True always, False never."""
    if progress is False:
        return False

    def bar(**options: Any) -> tqdm:
        options["desc"] = label
        interval = 0.1 if sys.stderr.isatty() else LOG_REFRESH_S
        return tqdm(**options, mininterval=interval, disable=None if progress is None else False)

    return bar

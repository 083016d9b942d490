"""Leading and trailing silence cut from a spoken clip, in training and in serving.

The default model's spoken clips are cut when they are made (`muse.train.data.speech`), and
espeak-ng starts speaking within about 12 ms of a clip's start, so the model never heard
more than that before the first word: a third of a second of silence before a spoken number,
as most recordings have, took its accuracy from 40 of 40 to 6 of 40. The processor cuts every
clip the same way when `processor_config.json` says `trim_audio_silence`, keeping
`SERVING_LEADING_MARGIN_SECONDS` before the first loud sample. Training runs the same
processor (the preset's settings turn the cut on), so its augmented clips are cut again there
exactly as served clips are; the cut at synthesis keeps the stored clips short.

A sample is loud when its magnitude is above `SILENCE_LEVEL` times the clip's peak; a margin
of quiet is kept at each end so that onsets and releases are not cut.
"""

from __future__ import annotations

import numpy as np

SILENCE_LEVEL = 0.02
SILENCE_MARGIN_SECONDS = 0.05
# About the silence espeak-ng opens a clip with (the most the model heard before speech).
SERVING_LEADING_MARGIN_SECONDS = 0.01


def trim_silence(waveform: np.ndarray, rate: int,
                 leading_margin_seconds: float = SILENCE_MARGIN_SECONDS) -> np.ndarray:
    """`waveform` (1-D) without its leading and trailing silence, a short margin kept at each
    end; an all-zero clip is returned whole."""
    peak = float(np.abs(waveform).max(initial=0.0))
    if peak == 0.0:
        return waveform
    loud = np.flatnonzero(np.abs(waveform) > SILENCE_LEVEL * peak)
    start = max(0, loud[0] - int(leading_margin_seconds * rate))
    return waveform[start:loud[-1] + 1 + int(SILENCE_MARGIN_SECONDS * rate)]

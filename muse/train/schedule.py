"""Learning-rate schedule: linear warmup, then a cosine decay to a floor."""

from __future__ import annotations

import math


def learning_rate(step: int, peak: float, warmup_steps: int, total_steps: int,
                  min_ratio: float) -> float:
    """The rate for optimizer step `step` (0-based): rises linearly over `warmup_steps`, then
    follows half a cosine from `peak` down to `peak * min_ratio` at `total_steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))

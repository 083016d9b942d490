"""Plots saved as small PNGs: the repository keeps every run's curves, and its working tree
must stay small enough to travel to the GPU machine whole."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from PIL import Image

# Line plots use a few colours and their antialiased edges: 64 keep them indistinguishable
# from the full-colour image at a quarter of the bytes.
PALETTE_COLOURS = 64


def save_figure(figure: Any, path: str | Path, dpi: int) -> None:
    """Write a matplotlib figure to `path` as a palette PNG of PALETTE_COLOURS colours."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    buffer.seek(0)
    with Image.open(buffer) as image:
        palette = image.convert("RGB").quantize(colors=PALETTE_COLOURS,
                                                method=Image.Quantize.MEDIANCUT)
    palette.save(path, format="PNG", optimize=True)

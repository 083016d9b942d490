"""scripts/pillow_pictures.py: pictures drawn with Pillow's colour names, asked about."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from scipy import ndimage

from muse.presets import SHIPPED_CHECKPOINT
from muse.train.data import vision_tasks
from tests.train.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("pillow_pictures")


def test_pictures_take_pillows_colour_or_the_palettes(script) -> None:
    pillow = np.asarray(script.picture(script.VARIANTS["Pillow names 400x300"], "square",
                                       "brown"))
    assert pillow.shape == (300, 400, 3)
    assert tuple(pillow[150, 200]) == (165, 42, 42) and tuple(pillow[0, 0]) == (255, 255, 255)
    palette = np.asarray(script.picture(script.VARIANTS["training palette"], "circle", "pink"))
    assert tuple(palette[112, 112]) == vision_tasks.COLOURS["pink"]


def test_scattered_pictures_hold_that_many_shapes_apart(script) -> None:
    rng = random.Random(2)
    for count in range(1, 6):
        pixels = np.asarray(script.scattered(script.VARIANTS["Pillow names 400x300"], count,
                                             rng))
        blobs = ndimage.label(np.any(pixels != 255, axis=-1))[1]
        assert blobs == count


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="needs the shipped checkpoint")
def test_the_script_asks_both_questions_and_lists_the_misses(script, tmp_path) -> None:
    out = tmp_path / "pictures.json"
    assert script.main([str(SHIPPED_CHECKPOINT), "--variants", "Pillow names,training palette",
                        "--colours", "red,brown", "--shapes", "circle", "--counts", "1",
                        "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {f"{variant} / {question}"
                                      for variant in ("Pillow names", "training palette")
                                      for question in ("colour", "shape", "count")}
    wrong = sum(cell["asked"] - cell["right"] for cell in report["results"].values())
    assert all(cell["asked"] == (5 if label.endswith("count") else 2)
               for label, cell in report["results"].items())
    assert wrong == len(report["misses"])
    for miss in report["misses"]:
        assert miss["reply"].lower() != miss["answer"]


def test_unknown_variants_are_refused(script) -> None:
    with pytest.raises(SystemExit):
        script.main(["model", "--variants", "sepia"])

"""Shared stand-ins for the training tests."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np

from muse.train.data.vision_tasks import _messages


class NoiseSpeechPool:
    """A stand-in for `speech.SpeechPool`: cases whose audio is noise (no espeak-ng needed),
    enough to check how clips travel through batches and the model."""

    def sample_case(self, rng: random.Random) -> SimpleNamespace:
        audio = np.random.default_rng(rng.randrange(2**32)).standard_normal(
            rng.randint(4000, 30000)).astype(np.float32) * 0.1
        return SimpleNamespace(audio=audio, messages=lambda: _messages(
            "audio", "What number is spoken?", "The audio says seven.", "7"))


def load_script(name: str) -> ModuleType:
    """A script of `scripts/` (not a package) imported as a module, for its functions."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

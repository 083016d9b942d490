"""The small reference model the drafter tests draft for."""

from __future__ import annotations

import pytest

from muse.reference.model import MuseForCausalLM
from tests.speculative.test_drafter import TARGET


@pytest.fixture(scope="module")
def target() -> MuseForCausalLM:
    model = MuseForCausalLM(TARGET)
    model.init_weights(seed=0, std=0.2)
    return model.requires_grad_(False)

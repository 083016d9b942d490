"""Fixtures the quantization tests share."""

import pytest

from tests.quantization.ct_checkpoints import tiny_qwen3_moe


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A transformers Qwen3-MoE saved in BF16: the model and its folder."""
    model = tiny_qwen3_moe()
    folder = tmp_path_factory.mktemp("source")
    model.save_pretrained(folder)
    return model, folder

"""Fixtures the quantization tests share."""

import pytest


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A transformers Qwen3-MoE saved in BF16: the model and its folder. Imported here, not
    at the top: where compressed-tensors is missing (the GPU image) only the tests that use
    it skip, not every test of the folder."""
    from tests.quantization.ct_checkpoints import tiny_qwen3_moe

    model = tiny_qwen3_moe()
    folder = tmp_path_factory.mktemp("source")
    model.save_pretrained(folder)
    return model, folder

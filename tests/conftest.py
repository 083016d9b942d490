import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tests use small tensors: one thread avoids contention on small shared CPUs.
torch.set_num_threads(1)

# The engine's tests run on the GPU where there is one, on the CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE

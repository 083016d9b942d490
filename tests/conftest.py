import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU the Triton kernels run under Triton's interpreter, so their tests compare them
# with their torch twins on the CPU too. Triton reads this when it is first imported, which
# must therefore come after this line.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests use small tensors: one thread avoids contention on small shared CPUs.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parents[1]

# The engine's tests run on the GPU where there is one, on the CPU otherwise.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    return DEVICE

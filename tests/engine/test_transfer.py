"""Host <-> device copies of the overlapped schedule give exactly the values they were given."""

import pytest
import torch

from muse.engine.transfer import HostCopy, to_device
from tests.conftest import DEVICE


def test_to_device_keeps_values_shape_and_dtype():
    device = torch.device(DEVICE)
    ids = to_device([[1, 2, 3], [4, 5, 6]], device)
    assert ids.device.type == device.type and ids.dtype == torch.long
    assert ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    scales = to_device([0.5, 2.0], device, torch.float32)
    assert scales.dtype == torch.float32 and scales.tolist() == [0.5, 2.0]


def test_host_copy_reads_what_the_device_computed():
    tokens = torch.arange(6, device=torch.device(DEVICE)) * 3
    assert HostCopy(tokens).tolist() == [0, 3, 6, 9, 12, 15]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned copies need a GPU")
def test_host_copy_does_not_wait_for_later_work():
    values = torch.arange(8, device="cuda")
    copy = HostCopy(values * 2)
    values.zero_()  # queued after the copy: does not change what it read
    slow = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):  # about 0.1 s of work queued behind the copy
        slow = slow @ slow / 64
    assert copy.tolist() == [2 * v for v in range(8)]
    assert not torch.cuda.current_stream().query()  # read back while the rest still runs
    staged = [to_device(list(range(i, i + 4)), torch.device("cuda")) for i in range(32)]
    assert [t.tolist() for t in staged] == [list(range(i, i + 4)) for i in range(32)]

"""LazySlice: narrows and selects compose, read the same elements from a tensor and from a
safetensors slice, and read nothing before `read`."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from muse.layers.lazy_slice import LazySlice, copy_into
from tests.layers.common import RecordingSlice, write_safetensors


def test_tensor_and_safetensors_agree(tmp_path) -> None:
    full = torch.arange(4 * 6 * 5, dtype=torch.float32).view(4, 6, 5)
    path = write_safetensors(tmp_path / "t.safetensors", {"t": full, "s": torch.tensor(2.5)})
    expected = full[1:3].select(2, 4)[:, 2:5].narrow(1, 1, 2)
    with safe_open(str(path), framework="pt") as checkpoint:
        recording = RecordingSlice(checkpoint.get_slice("t"))
        for source in (full, recording):
            view = LazySlice(source).narrow(0, 1, 2).select(2, 4).narrow(1, 2, 3).narrow(1, 1, 2)
            assert view.shape == (2, 2) and view.ndim == 2
            assert recording.elements_read == 0  # nothing read yet
            torch.testing.assert_close(view.read(), expected, rtol=0, atol=0)
        assert recording.elements_read == 4
        scalar = torch.empty(1)
        copy_into(scalar, checkpoint.get_slice("s"), "scale")  # [] into [1]
        assert scalar.item() == 2.5


def test_out_of_range_is_refused() -> None:
    view = LazySlice(torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"cannot take \[4, 8\) of dimension 1 of a checkpoint "
                                         r"tensor of shape \(4, 6\)"):
        view.narrow(1, 4, 4)
    with pytest.raises(ValueError, match="dimension 2 is out of range"):
        view.select(2, 0)
    with pytest.raises(ValueError, match=r"w: the checkpoint gives shape \(4, 6\) where this "
                                         r"rank's parameter slice has shape \(6, 4\)"):
        copy_into(torch.empty(6, 4), view, "w")

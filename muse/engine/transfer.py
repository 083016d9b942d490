"""Host <-> device copies that do not make the host wait for the device.

A copy from ordinary (pageable) host memory may wait for everything queued on the stream, which
would undo the overlapped schedule: the host preparing step n+1 would stall until step n is
done. So on CUDA host data goes through pinned memory with asynchronous copies. PyTorch's pinned
allocator keeps a block until the copy that reads it has run, so nothing is overwritten early.
"""

from __future__ import annotations

import torch


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """`values` (a list, or a list of equal-length lists) as a tensor on `device`."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values, copied back as soon as the device has computed them.

    The copy is queued right behind the kernels that produce the tensor, so reading it waits
    for those and not for whatever was queued after them."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            self.host, self.ready = tensor, None
            return
        self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.host.copy_(tensor, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(tensor.device))

    def tolist(self) -> list:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()

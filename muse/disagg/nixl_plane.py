"""KV bytes over NIXL (`"kv_connector": "NixlConnector"`, where the `nixl` package is
installed): each instance runs a NIXL agent with the UCX backend; a pair's gloo group
(`transport`) carries the producer's agent name once and then each pull's control
messages, and the bytes move one-sided:

    producer: registers the pulled blocks' buffers with its agent
              -> its agent's metadata (naming that memory): int64 [1] size, uint8 bytes
              -> int64 [buffers, 3]: (address, bytes, device id) of each
    consumer: registers buffers of the same sizes, READs the producer's into them, waits
              for the transfer, deregisters
              -> int64 [1]: done (the producer then deregisters and drops its buffers)

UCX picks the fastest path it has between the two buffers (shared memory on one host, RDMA
between hosts). The buffers are host memory today (the blocks as `read_blocks` copies
them); registering the device caches themselves, so GPUs read each other's blocks
directly, is the next step.
"""

from __future__ import annotations

import importlib
import itertools
import os
import time

import torch
import torch.distributed as dist

from muse.disagg.transport import BytesPlane, KVTransferError, recv_tensor, send_tensor

_names = itertools.count()


def nixl_available() -> bool:
    try:
        importlib.import_module("nixl._api")  # its CUDA or CPU backend loads too
    except ImportError:
        return False
    return True


class NixlPlane(BytesPlane):
    def __init__(self, timeout_s: float) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.timeout_s = timeout_s
        self.name = f"muse-{os.getpid()}-{next(_names)}"
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))

    def handshake(self, group: dist.ProcessGroup, peer: int) -> tuple[int, str]:
        """Returns the peer's (rank in the pair, agent name): the consumer learns the
        producer's agent from its metadata, which comes again with each pull (it names the
        memory registered for that pull); the producer only answers reads."""
        name = torch.frombuffer(bytearray(self.name.encode()), dtype=torch.uint8)
        if peer == 1:  # the producer
            send_tensor(group, torch.tensor([name.numel()]), peer)
            send_tensor(group, name, peer)
            return peer, ""
        size = int(recv_tensor(group, torch.zeros(1, dtype=torch.int64), peer))
        return peer, bytes(recv_tensor(group, torch.zeros(size, dtype=torch.uint8), peer)
                           .tolist()).decode()

    def send(self, group: dist.ProcessGroup, peer: tuple[int, str],
             tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        rank = peer[0]
        tensors = [tensor.contiguous() for tensor in tensors]
        registered = self.agent.register_memory(tensors)
        try:
            metadata = torch.frombuffer(bytearray(self.agent.get_agent_metadata()),
                                        dtype=torch.uint8)
            send_tensor(group, torch.tensor([metadata.numel()]), rank)
            send_tensor(group, metadata, rank)
            send_tensor(group, torch.tensor([[t.data_ptr(), t.numel() * t.element_size(),
                                        max(t.get_device(), 0)] for t in tensors]), rank)
            recv_tensor(group, torch.zeros(1, dtype=torch.int64), rank)  # read and done
        finally:
            self.agent.deregister_memory(registered)

    def receive(self, group: dist.ProcessGroup, peer: tuple[int, str],
                shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        if not shapes:
            return []
        rank, name = peer
        out = [torch.empty(shape, dtype=torch.uint8) for shape in shapes]
        size = int(recv_tensor(group, torch.zeros(1, dtype=torch.int64), rank))
        metadata = bytes(recv_tensor(group, torch.zeros(size, dtype=torch.uint8), rank).tolist())
        added = self.agent.add_remote_agent(metadata)
        if (added.decode() if isinstance(added, bytes) else added) != name:
            raise KVTransferError("the NIXL metadata is not the producer's agent")
        remote = recv_tensor(group, torch.zeros((len(shapes), 3), dtype=torch.int64), rank).tolist()
        registered = self.agent.register_memory(out)
        try:
            handle = self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(out),
                self.agent.get_xfer_descs([tuple(row) for row in remote], "DRAM"), name)
            try:
                state = self.agent.transfer(handle)
                deadline = time.monotonic() + self.timeout_s
                while state == "PROC" and time.monotonic() < deadline:
                    time.sleep(0.0005)
                    state = self.agent.check_xfer_state(handle)
                if state != "DONE":
                    raise KVTransferError(f"a NIXL read of KV blocks ended {state}")
            finally:
                self.agent.release_xfer_handle(handle)
        finally:
            self.agent.deregister_memory(registered)
        send_tensor(group, torch.ones(1, dtype=torch.int64), rank)
        return out

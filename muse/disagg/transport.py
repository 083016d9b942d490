"""KV blocks between instances over torch.distributed: one two-rank process group per
(producer, consumer) pair, built on the producer's TCPStore and outside any default world.

The producer (`PairListener`) runs a TCPStore server on `kv_ip:kv_port`; a consumer
(`PairClient`) takes a pair number from the store, both build a gloo group under that
number's prefix, and a producer thread answers the consumer's pulls on it for as long as
the group lives. A pull:

    consumer -> header int64[6]: keys, request id bytes, bytes of one block of each kind
                (kinds in sorted order; 0 where absent), 0, 0
             -> the keys, uint8 [keys * 32], and the producer's request id, uint8
    producer -> int64[3]: status (0: ok; 1: blocks of another size: another model or
                layout), how many blocks of each kind follow
             -> uint8 [kinds * keys]: which keys each kind has
             -> per kind with blocks: uint8 [count, block bytes], the blocks as they are in
                memory ([layers, 2, block_size, kv_heads, head_dim] of the KV dtype), through
                the pair's data plane

The data plane (`BytesPlane`) moves the blocks: `GlooPlane` sends them on the group (host
buffers, on a CPU or a GPU machine alike); `muse.disagg.nixl_plane.NixlPlane` registers
them with a NIXL agent and the consumer reads them one-sided (UCX), the group carrying only
the descriptors and the consumer's acknowledgement.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from muse.disagg.engine_kv import PulledBlocks
from muse.engine.prefix_keys import BlockKey

logger = logging.getLogger("muse.disagg")
HEADER = 6
KEY_BYTES = 32
STATUS_OK, STATUS_MISMATCH = 0, 1
PullHandler = Callable[[str, list[BlockKey]], PulledBlocks]


class BytesPlane:
    """How a pair moves block bytes; the group carries everything else."""

    def handshake(self, group: dist.ProcessGroup, peer: int) -> object:
        """Called once per pair on both sides after the group forms; returns the peer's
        handle for `send` / `receive`."""
        return peer

    def send(self, group: dist.ProcessGroup, peer: object, tensors: list[torch.Tensor]
             ) -> None:
        for tensor in tensors:
            send_tensor(group, tensor, peer)

    def receive(self, group: dist.ProcessGroup, peer: object,
                shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        return [recv_tensor(group, torch.zeros(shape, dtype=torch.uint8), peer) for shape in shapes]


GlooPlane = BytesPlane  # the bytes on the gloo group itself


class KVTransferError(RuntimeError):
    """A pull failed (the producer is gone, timed out, or serves another model)."""


def _group(store: dist.Store, pair: int, rank: int, timeout_s: float) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(f"pair{pair}", store), rank, 2,
                                 datetime.timedelta(seconds=timeout_s))


def send_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> None:
    group.send([tensor.contiguous()], peer, 0).wait()


def recv_tensor(group: dist.ProcessGroup, tensor: torch.Tensor, peer: int) -> torch.Tensor:
    group.recv([tensor], peer, 0).wait()
    return tensor


class PairListener:
    """The producer's side: accepts consumers and answers their pulls with `handler`."""

    def __init__(self, host: str, port: int, kinds: list[str], block_bytes: dict[str, int],
                 handler: PullHandler, timeout_s: float, plane: BytesPlane | None = None
                 ) -> None:
        self.plane = plane or GlooPlane()
        self.kinds = sorted(kinds)
        self.block_bytes = block_bytes
        self.handler = handler
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self.stopped = threading.Event()
        threading.Thread(target=self._accept, name="muse-kv-accept", daemon=True).start()

    def _accept(self) -> None:
        served = 0
        while not self.stopped.wait(0.05):
            while served < self.store.add("pairs", 0):
                served += 1
                threading.Thread(target=self._serve, args=(served,), daemon=True,
                                 name=f"muse-kv-pair{served}").start()

    def _serve(self, pair: int) -> None:
        try:
            group = _group(self.store, pair, 0, self.timeout_s)
            peer = self.plane.handshake(group, 1)
            while not self.stopped.is_set():
                self._answer(group, peer)
        except RuntimeError as error:  # the consumer left: its group is done
            logger.info("KV pair %d closed: %s", pair, error)

    def _answer(self, group: dist.ProcessGroup, peer: object) -> None:
        header = recv_tensor(group, torch.zeros(HEADER, dtype=torch.int64), 1).tolist()
        num_keys, id_bytes = header[0], header[1]
        keys = recv_tensor(group, torch.zeros(num_keys * KEY_BYTES, dtype=torch.uint8), 1) \
            if num_keys else torch.zeros(0, dtype=torch.uint8)
        request_id = bytes(recv_tensor(group, torch.zeros(id_bytes, dtype=torch.uint8), 1)
                           .tolist()).decode() if id_bytes else ""
        theirs = dict(zip(self.kinds, header[2:4]))
        if any(theirs[kind] != self.block_bytes[kind] for kind in self.kinds):
            send_tensor(group, torch.tensor([STATUS_MISMATCH, 0, 0]), 1)
            return
        key_list = [bytes(keys[i * KEY_BYTES:(i + 1) * KEY_BYTES].tolist())
                    for i in range(num_keys)]
        blocks = self.handler(request_id, key_list)
        counts = [int(blocks[kind][1].shape[0]) for kind in self.kinds]
        send_tensor(group, torch.tensor([STATUS_OK, *counts, *[0] * (2 - len(counts))]), 1)
        present = [flag for kind in self.kinds for flag in blocks[kind][0]]
        if present:
            send_tensor(group, torch.tensor(present, dtype=torch.uint8), 1)
        self.plane.send(group, peer, [blocks[kind][1] for kind, count
                                      in zip(self.kinds, counts) if count])

    def close(self) -> None:
        self.stopped.set()


class PairClient:
    """The consumer's side: one group per producer address, made on first use."""

    def __init__(self, kinds: list[str], block_bytes: dict[str, int], timeout_s: float,
                 plane: BytesPlane | None = None) -> None:
        self.plane = plane or GlooPlane()
        self.kinds = sorted(kinds)
        self.block_bytes = block_bytes
        self.timeout_s = timeout_s
        # (host, port) -> (store, group, the peer's handle in the data plane)
        self.groups: dict[tuple[str, int], tuple[dist.Store, dist.ProcessGroup, object]] = {}

    def _connect(self, host: str, port: int) -> tuple[dist.ProcessGroup, object]:
        if (host, port) not in self.groups:
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=self.timeout_s))
            pair = store.add("pairs", 1)
            group = _group(store, pair, 1, self.timeout_s)
            self.groups[(host, port)] = (store, group, self.plane.handshake(group, 0))
        return self.groups[(host, port)][1:]

    def pull(self, host: str, port: int, request_id: str, keys: list[BlockKey]
             ) -> PulledBlocks:
        """The blocks the producer at host:port holds for `keys` (its request
        `request_id`'s prompt, whose hold the pull releases)."""
        try:
            group, peer = self._connect(host, port)
            encoded = request_id.encode()
            sizes = [self.block_bytes[kind] for kind in self.kinds]
            send_tensor(group, torch.tensor([len(keys), len(encoded), *sizes,
                                       *[0] * (4 - len(sizes))]), 0)
            if keys:
                send_tensor(group, torch.frombuffer(bytearray(b"".join(keys)),
                                                    dtype=torch.uint8), 0)
            if encoded:
                send_tensor(group, torch.frombuffer(bytearray(encoded), dtype=torch.uint8), 0)
            status, *counts = recv_tensor(group, torch.zeros(3, dtype=torch.int64), 0).tolist()
            if status != STATUS_OK:
                raise KVTransferError(f"the producer at {host}:{port} serves blocks of "
                                      "another size (another model, dtype or block size)")
            present = recv_tensor(group, torch.zeros(len(self.kinds) * len(keys),
                                               dtype=torch.uint8), 0).tolist() if keys else []
            received = iter(self.plane.receive(group, peer, [
                (count, self.block_bytes[kind]) for kind, count in zip(self.kinds, counts)
                if count]))
            pulled: PulledBlocks = {}
            for index, (kind, count) in enumerate(zip(self.kinds, counts)):
                flags = [bool(f) for f in present[index * len(keys):(index + 1) * len(keys)]]
                pulled[kind] = (flags, next(received) if count else
                                torch.zeros((0, self.block_bytes[kind]), dtype=torch.uint8))
            return pulled
        except (RuntimeError, ValueError) as error:
            self.groups.pop((host, port), None)  # a broken group is not reused
            if isinstance(error, KVTransferError):
                raise
            raise KVTransferError(f"pulling KV from {host}:{port} failed: {error}") from None

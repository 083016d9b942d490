"""The prefill instance's side of disaggregation: answer decode instances' pulls with the
blocks its prefix index holds for their keys.

Pulls arrive on transport threads; the engine's own thread answers them between steps
(`serve`), where the scheduler's state is its to read, and lets go of the request's held
blocks (`KVCacheManager.holds`: a request sent with `do_remote_decode` keeps its blocks after
it finishes, until pulled or `kv_transfer_timeout_s` later).
"""

from __future__ import annotations

import queue
import time

from muse.disagg.config import KVTransferConfig
from muse.disagg.engine_kv import EngineKV, PulledBlocks, read_blocks
from muse.disagg.transport import BytesPlane, PairListener
from muse.engine.prefix_keys import BlockKey


class KVExporter:
    def __init__(self, kv: EngineKV, config: KVTransferConfig,
                 plane: BytesPlane | None = None) -> None:
        self.kv = kv
        self.timeout_s = config.kv_transfer_timeout_s
        kv.kv_cache.hold_timeout_s = config.kv_transfer_timeout_s
        self.jobs: queue.Queue = queue.Queue()
        self.listener = PairListener(config.kv_ip, config.kv_port, list(kv.kv_cache.groups),
                                     kv.block_bytes, self._pull, self.timeout_s, plane)

    def _pull(self, request_id: str, keys: list[BlockKey]) -> PulledBlocks:
        """On a transport thread: the engine's thread answers at its next `serve`."""
        reply: queue.Queue = queue.Queue(maxsize=1)
        self.jobs.put((request_id, keys, reply))
        try:
            return reply.get(timeout=self.timeout_s)
        except queue.Empty:
            raise RuntimeError("the engine did not answer a KV pull in time") from None

    def serve(self) -> None:
        """Answer the pulls waiting (call from the engine's thread, between steps)."""
        kv_cache = self.kv.kv_cache
        kv_cache.expire_holds(time.monotonic())
        while True:
            try:
                request_id, keys, reply = self.jobs.get_nowait()
            except queue.Empty:
                return
            pulled = read_blocks(self.kv, keys)
            kv_cache.release_hold(request_id)
            reply.put(pulled)

    def close(self) -> None:
        self.listener.close()

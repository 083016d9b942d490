"""`SharedStorageConnector`: KV blocks in a directory that several instances share (a local
disk or a network file system), named by prefix key, as vLLM's connector of that name.

A producer (`kv_producer` or `kv_both`) writes the blocks of every finished request's prompt;
a consumer (`kv_consumer` or `kv_both`) reads, for every text request that arrives, the
blocks the directory has for its prompt and enters them in its prefix cache, so the request
computes only the rest. The directory is `kv_connector_extra_config.shared_storage_path`;
files are `<kind>/<key>.kv`, a block's bytes as they are in memory. Give each model (and KV
dtype, block size) its own directory: a file whose size is not this engine's block size is
skipped, but one of the same size from another model would be read.

Reads and writes run on a thread of their own; the engine's thread only gathers a finished
request's blocks into host memory.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from muse.disagg.config import KVTransferConfig
from muse.disagg.connector import KVConnector
from muse.disagg.engine_kv import EngineKV, PulledBlocks, read_blocks
from muse.engine.prefix_keys import BlockKey, prompt_block_keys
from muse.engine.request import Request

class SharedStorageConnector(KVConnector):
    def __init__(self, kv: EngineKV, config: KVTransferConfig) -> None:
        super().__init__(kv, config)
        self.root = Path(config.kv_connector_extra_config["shared_storage_path"])
        for kind in kv.kv_cache.groups:
            (self.root / kind).mkdir(parents=True, exist_ok=True)
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muse-kv-storage")

    def start_load_kv(self, request_id: str, prompt_token_ids: list[int],
                      cache_salt: str | None, kv_transfer_params: dict[str, Any] | None
                      ) -> Future | None:
        if not self.config.is_consumer:
            return None
        keys = prompt_block_keys(prompt_token_ids, self.kv.kv_cache.block_size, cache_salt)
        groups = self.kv.kv_cache.groups
        first = groups[next(iter(groups))].index
        if not keys or all(first.lookup(key) is not None for key in keys) \
                or not any(self._file(kind, keys[0]).exists() for kind in groups):
            return None  # cached here already, or the directory lacks its first block
        return self.io.submit(lambda: (keys, self._read(keys)))

    def request_finished(self, request: Request) -> None:
        if not self.config.is_producer or request.media or request.lora is not None:
            return  # their blocks' keys carry media hashes or the adapter: not a text prompt's
        keys = prompt_block_keys(request.prompt_token_ids, self.kv.kv_cache.block_size,
                                 request.cache_salt)
        new = [key for key in keys
               if not all(self._file(kind, key).exists() for kind in self.kv.kv_cache.groups)]
        if new:
            self.io.submit(self._write, new, read_blocks(self.kv, new))

    def close(self) -> None:
        self.io.shutdown(wait=True)

    def _file(self, kind: str, key: BlockKey) -> Path:
        return self.root / kind / f"{key.hex()}.kv"

    def _read(self, keys: list[BlockKey]) -> PulledBlocks:
        pulled: PulledBlocks = {}
        for kind in self.kv.kv_cache.groups:
            size = self.kv.block_bytes[kind]
            present, rows = [], []
            for key in keys:
                path = self._file(kind, key)
                found = path.is_file() and path.stat().st_size == size
                if found:
                    rows.append(torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8))
                present.append(found)
            pulled[kind] = (present, torch.stack(rows) if rows
                            else torch.zeros((0, size), dtype=torch.uint8))
        return pulled

    def _write(self, keys: list[BlockKey], pulled: PulledBlocks) -> None:
        for kind, (present, data) in pulled.items():
            rows = iter(data)
            for key, found in zip(keys, present):
                if not found:
                    continue
                path = self._file(kind, key)
                partial = path.with_suffix(f".{os.getpid()}.partial")
                partial.write_bytes(next(rows).numpy().tobytes())
                os.replace(partial, path)  # a reader never sees half a block

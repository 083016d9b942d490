"""The decode instance's side of disaggregation: before a request sent with
`kv_transfer_params` (`do_remote_prefill`) is queued, pull its prompt's blocks from the
prefill instance named there and enter them in the prefix cache, as if this instance had
computed them; the request then finds them as a prefix-cache hit and computes only the rest.
The pull runs on a transport thread while the engine steps on; the engine's thread enters
the blocks (`engine_kv.enter_blocks`) and queues the request.

A pull that fails leaves the cache as it was: the request computes its whole prompt here.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from muse.disagg.config import KVTransferConfig
from muse.disagg.engine_kv import EngineKV
from muse.disagg.transport import BytesPlane, PairClient
from muse.engine.errors import InvalidRequestError
from muse.engine.prefix_keys import prompt_block_keys

REMOTE_FIELDS = ("remote_host", "remote_port", "remote_request_id")


def check_kv_transfer_params(params: Any) -> None:
    if not isinstance(params, dict):
        raise InvalidRequestError("kv_transfer_params must be an object",
                                  param="kv_transfer_params")
    if params.get("do_remote_prefill"):
        missing = [name for name in REMOTE_FIELDS if name not in params]
        if missing:
            raise InvalidRequestError(f"kv_transfer_params with do_remote_prefill needs "
                                      f"{missing}", param="kv_transfer_params")


class KVImporter:
    def __init__(self, kv: EngineKV, config: KVTransferConfig,
                 plane: BytesPlane | None = None) -> None:
        self.kv = kv
        self.client = PairClient(list(kv.kv_cache.groups), kv.block_bytes,
                                 config.kv_transfer_timeout_s, plane)
        # One transport thread: pulls go out one at a time, in arrival order.
        self.pulls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="muse-kv-pull")

    def start(self, params: dict[str, Any], prompt_token_ids: list[int],
              cache_salt: str | None = None) -> Future:
        """Pull the prompt's blocks on the transport thread (the engine steps on meanwhile);
        the future's result, (keys, blocks), goes to `enter_blocks`; its exception is a
        KVTransferError."""
        keys = prompt_block_keys(prompt_token_ids, self.kv.kv_cache.block_size, cache_salt)
        return self.pulls.submit(lambda: (keys, self.client.pull(
            str(params["remote_host"]), int(params["remote_port"]),
            str(params["remote_request_id"]), keys)))

"""The KV connector interface: how an engine moves KV blocks to and from places beyond its
own tiers (another instance, shared storage), in the spirit of vLLM's KV connectors.

Blocks are named by their prefix keys (`muse.engine.prefix_keys`), the same in every process
and on every machine, so a connector needs no request bookkeeping to find a prompt's
blocks: it moves (key, block bytes) pairs. The engine calls, on its own thread:

- `start_load_kv(request_id, prompt_token_ids, cache_salt, kv_transfer_params)` when a
  request arrives: None, or a future of (keys, `PulledBlocks`) that the engine enters into
  its prefix cache (`engine_kv.enter_blocks`) before it schedules the request, which waits
  unscheduled meanwhile; the request then computes only what the blocks do not cover. A
  future that fails with `KVTransferError` leaves the request to compute its whole prompt;
- `delay_free(kv_transfer_params)`: whether the request, once finished, keeps its blocks
  for a transfer (the connector lets go with `EngineKV.kv_cache.release_hold`);
- `request_finished(request)`: a request is done, its blocks still in place;
- `serve()` between steps, also while idle: answer transfers, expire holds;
- `close()`.

And inside each forward pass, layer by layer, where the connector overrides them (vLLM's
names; the engine then runs every step eagerly, as captured graphs call no Python):

- `wait_for_layer_load(position)` before the rank's layer `position` runs: a connector
  that loads asynchronously waits here for that layer's blocks;
- `save_kv_layer(position, kv_cache, meta)` after it: the layer's (K, V) cache with the
  step's tokens written (`meta.kinds[kind].slot_mapping` gives each token's slot), to send or
  store layer by layer.

`--kv-transfer-config` picks one: `"kv_connector": "MuseConnector"` (prefill / decode
instances over torch.distributed, `muse_connector.py`), `"SharedStorageConnector"` (a
directory several instances share, `shared_storage.py`), or a class of your own, named with
`"kv_connector_module_path": "package.module"`, built as `Class(kv, config)`.
"""

from __future__ import annotations

import importlib
from concurrent.futures import Future
from typing import Any

import torch

from muse.disagg.config import KVTransferConfig
from muse.disagg.engine_kv import EngineKV
from muse.engine.request import Request
from muse.kernels.attention_metadata import BatchMetadata


class KVConnector:
    """The base: a connector that moves nothing; subclasses override what they do."""

    def __init__(self, kv: EngineKV, config: KVTransferConfig) -> None:
        self.kv = kv
        self.config = config

    def start_load_kv(self, request_id: str, prompt_token_ids: list[int],
                      cache_salt: str | None, kv_transfer_params: dict[str, Any] | None
                      ) -> Future | None:
        return None

    def delay_free(self, kv_transfer_params: dict[str, Any] | None) -> bool:
        return False

    def request_finished(self, request: Request) -> None:
        pass

    def serve(self) -> None:
        pass

    def close(self) -> None:
        pass

    def wait_for_layer_load(self, position: int) -> None:
        pass

    def save_kv_layer(self, position: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      meta: BatchMetadata) -> None:
        pass

    @property
    def has_layer_hooks(self) -> bool:
        """Whether this connector overrides a per-layer hook (then the forward calls them)."""
        return (type(self).wait_for_layer_load is not KVConnector.wait_for_layer_load
                or type(self).save_kv_layer is not KVConnector.save_kv_layer)


class ConnectorLayerHooks:
    """A connector's per-layer hooks as the forward pass calls them (`LayerHooks`)."""

    def __init__(self, connector: KVConnector) -> None:
        self.connector = connector

    def before_layer(self, position: int) -> None:
        self.connector.wait_for_layer_load(position)

    def after_layer(self, position: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: BatchMetadata) -> None:
        self.connector.save_kv_layer(position, kv_cache, meta)


def class_in_module(module_path: str, name: str, base: type, field: str) -> type:
    """The class `name` of the module `module_path` (a connector of one's own), which must
    derive from `base`; `field` names the config field that named it, for the error."""
    cls = getattr(importlib.import_module(module_path), name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        article = "an" if base.__name__[0] in "AEIOU" else "a"
        raise ValueError(f"`{field}` {name!r} is not {article} {base.__name__} class of "
                         f"{module_path}")
    return cls


def load_connector(kv: EngineKV, config: KVTransferConfig) -> KVConnector:
    """The connector `config` names, built for this engine's KV."""
    if config.kv_connector_module_path is not None:
        return class_in_module(config.kv_connector_module_path, config.kv_connector,
                               KVConnector, "kv_connector")(kv, config)
    if config.kv_connector == "SharedStorageConnector":
        from muse.disagg.shared_storage import SharedStorageConnector

        return SharedStorageConnector(kv, config)
    from muse.disagg.muse_connector import MuseConnector

    return MuseConnector(kv, config)

"""`MuseConnector`: prefill / decode instances. A producer keeps a `do_remote_decode`
request's blocks after it finishes and answers pulls for them (`kv_export`); a consumer
pulls a `do_remote_prefill` request's prompt blocks from the producer its
`kv_transfer_params` name (`kv_import`), over torch.distributed (`transport`). The
`NixlConnector` is the same with the blocks' bytes moved by NIXL (`nixl_plane`)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from muse.disagg.config import KVTransferConfig
from muse.disagg.connector import KVConnector
from muse.disagg.engine_kv import EngineKV
from muse.disagg.kv_export import KVExporter
from muse.disagg.kv_import import KVImporter


class MuseConnector(KVConnector):
    """Also the `NixlConnector` (`kv_connector` picks the data plane)."""

    def __init__(self, kv: EngineKV, config: KVTransferConfig) -> None:
        super().__init__(kv, config)
        plane = None
        if config.kv_connector == "NixlConnector":
            from muse.disagg.nixl_plane import NixlPlane

            plane = NixlPlane(config.kv_transfer_timeout_s)
        self.exporter = KVExporter(kv, config, plane) if config.is_producer else None
        self.importer = KVImporter(kv, config, plane) if config.is_consumer else None

    def start_load_kv(self, request_id: str, prompt_token_ids: list[int],
                      cache_salt: str | None, kv_transfer_params: dict[str, Any] | None
                      ) -> Future | None:
        if self.importer is None or not (kv_transfer_params
                                         and kv_transfer_params.get("do_remote_prefill")):
            return None
        return self.importer.start(kv_transfer_params, prompt_token_ids, cache_salt)

    def delay_free(self, kv_transfer_params: dict[str, Any] | None) -> bool:
        return bool(self.exporter is not None and kv_transfer_params
                    and kv_transfer_params.get("do_remote_decode"))

    def serve(self) -> None:
        if self.exporter is not None:
            self.exporter.serve()

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()

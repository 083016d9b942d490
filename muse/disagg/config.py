"""`--kv-transfer-config`, in vLLM's shape: `{"kv_role": "kv_producer" | "kv_consumer" |
"kv_both", "kv_connector": "MuseConnector", "kv_ip": ..., "kv_port": ...}`.

With the `MuseConnector` a producer (prefill instance) listens on `kv_ip:kv_port` for decode
instances pulling KV blocks; a consumer (decode instance) pulls from the producer a
request's `kv_transfer_params` name. The `NixlConnector` does the same with the blocks'
bytes moved by NIXL agents (the `nixl` package; `muse/disagg/nixl_plane.py`). The
`SharedStorageConnector` reads and writes `kv_connector_extra_config.shared_storage_path`;
`kv_connector_module_path` names the module of a connector class of your own
(`muse/disagg/connector.py`). vLLM's other fields are accepted and have no effect here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from muse.json_options import json_object

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("MuseConnector", "NixlConnector", "SharedStorageConnector")
# vLLM's fields that describe its own connectors' buffers and ranks.
IGNORED_FIELDS = ("kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_buffer_size",
                  "engine_id", "kv_load_failure_policy")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_connector: str = "MuseConnector"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    # How long a producer holds a finished prefill's blocks for a pull, and how long a pull
    # may take before the decode instance computes the prompt itself.
    kv_transfer_timeout_s: float = 30.0
    kv_connector_extra_config: dict[str, Any] | None = None
    kv_connector_module_path: str | None = None

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: Any) -> KVTransferConfig | None:
        """A config from a dict, its JSON text or a config (None stays None)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = json_object(value, "kv_transfer_config")
        fields = {k: v for k, v in value.items() if k not in IGNORED_FIELDS}
        unknown = sorted(set(fields) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"`kv_transfer_config` has unknown fields {unknown}")
        if "kv_role" not in fields:
            raise ValueError(f"`kv_transfer_config` needs `kv_role`, one of {list(KV_ROLES)}")
        config = cls(**fields)
        config.validate()
        return config

    def validate(self) -> None:
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"`kv_role` must be one of {list(KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector == "NixlConnector" and self.kv_connector_module_path is None:
            from muse.disagg.nixl_plane import nixl_available

            if not nixl_available():
                raise ValueError("the NixlConnector needs the `nixl` package (pip install "
                                 "nixl), or use 'MuseConnector' (torch.distributed)")
        if self.kv_connector_extra_config is not None \
                and not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("`kv_connector_extra_config` must be an object")
        if self.kv_connector_module_path is not None:
            if not isinstance(self.kv_connector_module_path, str):
                raise ValueError("`kv_connector_module_path` must be a module name")
        elif self.kv_connector not in CONNECTORS:
            raise ValueError(f"`kv_connector` must be one of {list(CONNECTORS)}, got "
                             f"{self.kv_connector!r}")
        elif self.kv_connector == "SharedStorageConnector":
            path = (self.kv_connector_extra_config or {}).get("shared_storage_path")
            if not isinstance(path, str) or not path:
                raise ValueError('the SharedStorageConnector needs `kv_connector_extra_config`: '
                                 '{"shared_storage_path": DIR}')
        if not isinstance(self.kv_port, int) or not 0 < self.kv_port < 65536:
            raise ValueError(f"`kv_port` must be a TCP port, got {self.kv_port!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError("`kv_transfer_timeout_s` must be positive")

"""Encoder disaggregation (E/P/D): encoder outputs that one instance computes and others
read, by the media item's content hash, in the spirit of vLLM's EC connectors.

`--ec-transfer-config` in vLLM's shape: `{"ec_role": "ec_producer" | "ec_consumer" |
"ec_both", "ec_connector": "ECSharedStorageConnector", "ec_connector_extra_config":
{"shared_storage_path": DIR}}` (`ECExampleConnector`, vLLM's newer name for the same
connector, is accepted too; `ec_connector_module_path` names a class of your own).

- A producer (an encoder instance) answers each request by encoding its media items and
  saving the outputs, without running the decoder: the reply has no tokens
  (`EngineCore` keeps such requests out of the scheduler).
- A consumer (a prefill, decode or combined instance) looks an item up in the connector
  before encoding it (`ConnectedEncoders`); what is not there it encodes itself, so a
  lost encoder instance costs time, never an answer.

The shared-storage connector keeps one safetensors file per item under
`DIR/<model id>/<content hash>.safetensors`, written to a temporary name and renamed, so a
reader sees a whole file or none. The model id is drawn from what makes the outputs differ
(the checkpoint's file names and sizes, or a preset's name and seed, and the dtype), not
from paths, so instances on other machines with a copy of the checkpoint share it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from muse.disagg.connector import class_in_module
from muse.json_options import json_object

logger = logging.getLogger("muse.disagg")
EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
SHARED_STORAGE = ("ECSharedStorageConnector", "ECExampleConnector")


@dataclass(frozen=True)
class ECTransferConfig:
    ec_role: str
    ec_connector: str = "ECSharedStorageConnector"
    ec_connector_extra_config: dict[str, Any] | None = None
    ec_connector_module_path: str | None = None

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    @property
    def encodes_only(self) -> bool:
        """An encoder instance: requests are answered once their media are encoded."""
        return self.ec_role == "ec_producer"

    @classmethod
    def parse(cls, value: Any) -> ECTransferConfig | None:
        """A config from a dict, its JSON text or a config (None stays None)."""
        if value is None or isinstance(value, ECTransferConfig):
            return value
        value = json_object(value, "ec_transfer_config")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"`ec_transfer_config` has unknown fields {unknown}")
        if value.get("ec_role") not in EC_ROLES:
            raise ValueError(f"`ec_transfer_config` needs `ec_role`, one of {list(EC_ROLES)}; "
                             f"got {value.get('ec_role')!r}")
        config = cls(**value)
        extra = config.ec_connector_extra_config
        if extra is not None and not isinstance(extra, dict):
            raise ValueError("`ec_connector_extra_config` must be an object")
        if config.ec_connector_module_path is None:
            if config.ec_connector not in SHARED_STORAGE:
                raise ValueError(f"`ec_connector` must be one of {list(SHARED_STORAGE)} (or a "
                                 f"class of `ec_connector_module_path`), got "
                                 f"{config.ec_connector!r}")
            path = (extra or {}).get("shared_storage_path")
            if not isinstance(path, str) or not path:
                raise ValueError('the ECSharedStorageConnector needs `ec_connector_extra_config`: '
                                 '{"shared_storage_path": DIR}')
        return config


class ECConnector:
    """Where encoder outputs go and come from, by content hash. `model_id` names the
    encoders' weights and dtype (outputs of other weights are never read)."""

    def __init__(self, config: ECTransferConfig, model_id: str) -> None:
        self.config = config
        self.model_id = model_id

    def load(self, content_hash: str, device: torch.device) -> torch.Tensor | None:
        raise NotImplementedError

    def save(self, content_hash: str, embeddings: torch.Tensor) -> None:
        raise NotImplementedError


class ECSharedStorageConnector(ECConnector):
    """Encoder outputs as files in a directory every instance can read."""

    def __init__(self, config: ECTransferConfig, model_id: str) -> None:
        super().__init__(config, model_id)
        self.root = Path(config.ec_connector_extra_config["shared_storage_path"]) / model_id
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, content_hash: str) -> Path:
        if not content_hash.isalnum():
            raise ValueError(f"a content hash must be alphanumeric, got {content_hash!r}")
        return self.root / f"{content_hash}.safetensors"

    def load(self, content_hash: str, device: torch.device) -> torch.Tensor | None:
        path = self._path(content_hash)
        if not path.exists():
            return None
        return load_file(path, device=str(device))["embeddings"]

    def save(self, content_hash: str, embeddings: torch.Tensor) -> None:
        path = self._path(content_hash)
        partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
        save_file({"embeddings": embeddings.detach().contiguous().cpu()}, partial)
        os.replace(partial, path)


def load_ec_connector(config: ECTransferConfig, model_id: str) -> ECConnector:
    if config.ec_connector_module_path is not None:
        return class_in_module(config.ec_connector_module_path, config.ec_connector,
                               ECConnector, "ec_connector")(config, model_id)
    return ECSharedStorageConnector(config, model_id)


def encoder_model_id(model: str, seed: int, dtype: torch.dtype) -> str:
    """A name for the encoders' weights and dtype, the same on every machine."""
    from muse.presets import PRESETS

    if model in PRESETS:
        weights: Any = {"preset": model, "seed": seed}
    else:
        folder = Path(model)
        weights = sorted((path.name, path.stat().st_size) for path in folder.iterdir()
                         if path.suffix in (".json", ".safetensors"))
    identity = {"weights": weights, "dtype": str(dtype)}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def connected_encoders(encoders: Any, config: ECTransferConfig | None, model: str, seed: int,
                       dtype: torch.dtype, device: torch.device) -> Any:
    """`encoders` behind the connector `config` names; as they are without one (or without
    encoders)."""
    if config is None or encoders is None:
        return encoders
    return ConnectedEncoders(encoders, load_ec_connector(config, encoder_model_id(
        model, seed, dtype)), device)


class ConnectedEncoders:
    """Encoders (`muse.multimodal.engine_inputs.Encoders`) behind an EC connector: a
    consumer reads the items the connector has and encodes the rest; a producer saves what
    it encodes."""

    def __init__(self, encoders: Any, connector: ECConnector, device: torch.device) -> None:
        self.encoders = encoders
        self.connector = connector
        self.device = device
        self.media_kinds = encoders.media_kinds
        self.items_loaded = 0  # items read from the connector instead of encoded

    def encode(self, items: Sequence[Any]) -> list[torch.Tensor]:
        config = self.connector.config
        out = [self._load(item) if config.is_consumer else None for item in items]
        self.items_loaded += sum(tensor is not None for tensor in out)
        missing = [i for i, tensor in enumerate(out) if tensor is None]
        if missing:
            encoded = self.encoders.encode([items[i] for i in missing])
            for i, tensor in zip(missing, encoded):
                out[i] = tensor
                if config.is_producer:
                    self.connector.save(items[i].content_hash, tensor)
        return out  # type: ignore[return-value]

    def _load(self, item: Any) -> torch.Tensor | None:
        """The stored output of `item`, or None when there is none or it cannot be the
        item's (a damaged file, another row count): then the item is encoded here."""
        try:
            tensor = self.connector.load(item.content_hash, self.device)
        except Exception as error:  # a damaged file must not fail the step
            logger.warning("encoder output %s unreadable (%s): encoding it here",
                           item.content_hash, error)
            return None
        if tensor is not None and (tensor.dim() != 2 or tensor.shape[0] != item.num_tokens):
            logger.warning("encoder output %s has shape %s, not %d rows: encoding it here",
                           item.content_hash, list(tensor.shape), item.num_tokens)
            return None
        return tensor

"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's name (the `model` field of API requests selects it);
    lora_int_id: a positive id, changed when the name's weights change (a trainer's next
    step); lora_path: a PEFT adapter folder. A trainer in the same process may instead hand
    over `config` (the adapter_config.json contents) and `tensors` (the PEFT state dict)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    config: dict[str, Any] | None = None
    tensors: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if (self.config is None) != (self.tensors is None):
            raise ValueError("an in-memory adapter needs both config and tensors")

    @property
    def has_weights(self) -> bool:
        """Whether the request brings weights (a folder or tensors), not just a name."""
        return bool(self.lora_path) or self.tensors is not None


def parse_lora_module(module: str | dict[str, Any]) -> tuple[str, str]:
    """One `--lora-modules` entry as vLLM takes them: "name=path", or a JSON object / dict
    with "name" and "path" -> (name, path)."""
    if isinstance(module, str) and module.lstrip().startswith("{"):
        import json

        try:
            module = json.loads(module)
        except json.JSONDecodeError as error:
            raise ValueError(f"--lora-modules {module!r}: not valid JSON ({error})") from None
    if isinstance(module, dict):
        name, path = module.get("name"), module.get("path")
    elif isinstance(module, str) and "=" in module:
        name, path = module.split("=", 1)
    else:
        raise ValueError(f"--lora-modules {module!r}: expected name=path or "
                         '{"name": ..., "path": ...}')
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules {module!r}: both a name and a path are needed")
    return name, path

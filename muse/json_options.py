"""Settings given as a JSON object on the command line or as a dict in Python
(`--speculative-config`, `--kv-transfer-config`)."""

from __future__ import annotations

import json
from typing import Any


def json_object(value: dict[str, Any] | str, name: str) -> dict[str, Any]:
    """`value` as a dict: itself, or its JSON text parsed; a clear error naming `name`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"`{name}` is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"`{name}` must be a JSON object, got {type(value).__name__}")
    return value

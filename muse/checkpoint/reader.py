"""Lazy access to a checkpoint's tensors: shards are memory-mapped, tensors read on request."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from muse.checkpoint.layout import INDEX_FILE, SINGLE_WEIGHTS_FILE, CheckpointError, format_names


class CheckpointReader:
    """Tensors of a checkpoint folder by name.

    Opening reads the index and nothing else; a shard is mapped (header parsed) the first time
    one of its tensors is asked for, and `get` returns a tensor backed by that copy-on-write
    mapping, so bytes are paged in only when used. Loading one layer, or checking every shape,
    never pulls the whole checkpoint into memory.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        index_path = self.directory / INDEX_FILE
        if index_path.is_file():
            self._file_of = _read_index(index_path)
        elif (self.directory / SINGLE_WEIGHTS_FILE).is_file():
            self._file_of = {name: SINGLE_WEIGHTS_FILE
                             for name in self._handle(SINGLE_WEIGHTS_FILE).keys()}
        else:
            raise CheckpointError(f"checkpoint directory {self.directory} has neither "
                                  f"{SINGLE_WEIGHTS_FILE} nor {INDEX_FILE}")
        absent = sorted({file for file in self._file_of.values()
                         if not (self.directory / file).is_file()})
        if absent:
            raise CheckpointError(f"checkpoint {self.directory} is missing shard file(s) "
                                  f"listed in {INDEX_FILE}: {format_names(absent)}")

    def names(self) -> list[str]:
        return list(self._file_of)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def file_of(self, name: str) -> str:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the shard header, without reading the tensor."""
        return tuple(self.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        """Element type from the shard header, without reading the tensor."""
        return SAFETENSORS_DTYPES[self.get_slice(name).get_dtype()]

    def get(self, name: str) -> torch.Tensor:
        """The tensor, backed by the mapped shard (clone it to own aligned memory)."""
        return self._read(name, "get_tensor")

    def get_slice(self, name: str) -> Any:
        """A lazy view of the tensor: indexing it reads only the elements asked for."""
        return self._read(name, "get_slice")

    def release(self, file: str) -> None:
        """Unmap one shard (opened again if asked for later): its pages that were read stop
        counting against the process once no tensor read from it is alive."""
        handle = self._handles.pop(file, None)
        if handle is not None:
            handle.__exit__(None, None, None)

    def close(self) -> None:
        for file in list(self._handles):
            self.release(file)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _read(self, name: str, method: str) -> Any:
        """`get_tensor` or `get_slice` of the shard holding `name`, with a clear error."""
        file = self._file_of[name]
        try:
            return getattr(self._handle(file), method)(name)
        except SafetensorError as error:
            raise CheckpointError(f"cannot read tensor `{name}` from "
                                  f"{self.directory / file}: {error}") from None

    def _handle(self, file: str) -> Any:
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(self.directory / file, framework="pt",
                                                device="cpu")
            except (SafetensorError, OSError) as error:
                raise CheckpointError(f"cannot open shard {self.directory / file}: "
                                      f"{error}") from None
        return self._handles[file]


# The element types safetensors headers name, as torch dtypes.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _read_index(path: Path) -> dict[str, str]:
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{path} must hold an object with a `weight_map` from tensor "
                              f"names to shard file names")
    return weight_map

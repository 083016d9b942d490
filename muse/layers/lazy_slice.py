"""Narrowing a checkpoint tensor to one rank's part before any of it is read.

A weight loader is handed either a tensor or a safetensors slice (`safe_open(...).get_slice`),
which reads from the file only the elements an index asks for. `LazySlice` records `narrow`
and `select` calls on either as one index per source dimension and reads once, in `read`, so
a rank holding 1/8 of a matrix reads 1/8 of its bytes.
"""

from __future__ import annotations

from typing import Any

import torch

Index = slice | int


def _source_shape(source: Any) -> tuple[int, ...]:
    # torch tensors (and numpy arrays) have `.shape`; safetensors slices only `get_shape()`.
    if hasattr(source, "get_shape"):
        return tuple(source.get_shape())
    return tuple(source.shape)


class LazySlice:
    """A view of `source` (anything indexable by a tuple of slices and ints, with a shape).

    `shape` is the view's shape; `narrow` and `select` return new views and read nothing.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        source_shape = _source_shape(source)
        self._index: list[Index] = [slice(0, size) for size in source_shape]
        # Source dimension of each visible dimension (`select` hides the one it indexes).
        self._dims: list[int] = list(range(len(source_shape)))

    @classmethod
    def of(cls, loaded: Any) -> LazySlice:
        return loaded if isinstance(loaded, LazySlice) else cls(loaded)

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = []
        for dim in self._dims:
            index = self._index[dim]
            assert isinstance(index, slice)
            sizes.append(index.stop - index.start)
        return tuple(sizes)

    @property
    def ndim(self) -> int:
        return len(self._dims)

    def _copy(self) -> LazySlice:
        view = LazySlice.__new__(LazySlice)
        view.source, view._index, view._dims = self.source, list(self._index), list(self._dims)
        return view

    def _check(self, dim: int, start: int, length: int) -> int:
        if not -self.ndim <= dim < self.ndim:
            raise ValueError(f"dimension {dim} is out of range for a checkpoint tensor of "
                             f"shape {self.shape}")
        dim %= self.ndim
        size = self.shape[dim]
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"cannot take [{start}, {start + length}) of dimension {dim} of a "
                             f"checkpoint tensor of shape {self.shape}")
        return dim

    def narrow(self, dim: int, start: int, length: int) -> LazySlice:
        """Elements [start, start + length) of dimension `dim` (like `Tensor.narrow`)."""
        dim = self._check(dim, start, length)
        view = self._copy()
        source_dim = view._dims[dim]
        first = view._index[source_dim].start + start
        view._index[source_dim] = slice(first, first + length)
        return view

    def select(self, dim: int, index: int) -> LazySlice:
        """Element `index` of dimension `dim`, which disappears (like `Tensor.select`)."""
        dim = self._check(dim, index, 1)
        view = self._copy()
        source_dim = view._dims.pop(dim)
        view._index[source_dim] = view._index[source_dim].start + index
        return view

    def read(self) -> torch.Tensor:
        """The view's elements as a tensor; only they are read from a safetensors slice."""
        tensor = self.source[tuple(self._index)]
        return tensor if isinstance(tensor, torch.Tensor) else torch.as_tensor(tensor)


def copy_into(target: torch.Tensor, loaded: Any, what: str) -> None:
    """Read `loaded` (a tensor, a safetensors slice or a `LazySlice`) into `target`.

    Shapes must match exactly, except that a single-element source fills a single-element
    target of any shape (scalar scales are stored as [] or [1] by different tools).
    """
    view = LazySlice.of(loaded)
    same = view.shape == tuple(target.shape)
    scalars = target.numel() == 1 and all(size == 1 for size in view.shape)
    if not (same or scalars):
        raise ValueError(f"{what}: the checkpoint gives shape {view.shape} where this rank's "
                         f"parameter slice has shape {tuple(target.shape)}")
    tensor = view.read()
    target.copy_(tensor.reshape(target.shape))

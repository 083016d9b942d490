"""One process group and this rank's place in it, with the collectives the engine uses.

A group of one rank needs no `torch.distributed`: every collective is the identity, so
single-process runs never initialise anything. Collectives take and return tensors on the
device of `device_group` (CUDA under NCCL, CPU under gloo); metadata (`broadcast_object`,
`barrier`) goes through `cpu_group`, which is always gloo, so it never touches the GPU.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

# Collectives with two implementations: the backend's own, and one built from all-reduce,
# list all-gather and even all-to-all for a backend that lacks it. NCCL and gloo (torch 2.11
# and 2.13) have all of them, so groups use their own unless built with fewer.
OPS_WITH_FALLBACK = frozenset({"all_gather", "reduce_scatter", "all_to_all"})

# torch 2.13 renamed the single-tensor gather / scatter; torch 2.11 has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = (getattr(dist, "reduce_scatter_single", None)
                          or dist.reduce_scatter_tensor)


class GroupCoordinator:
    """The ranks of one group (global ranks, ascending) and the collectives among them.

    `src` / `dst` arguments are ranks in the group (0 .. world_size - 1), not global ranks.
    `native_ops` names the ops of `OPS_WITH_FALLBACK` the backend runs itself; the others use
    their fallback.
    """

    def __init__(self, ranks: Sequence[int], rank: int, device_group: Any = None,
                 cpu_group: Any = None, backend: str = "gloo",
                 device: torch.device | None = None,
                 native_ops: frozenset[str] = OPS_WITH_FALLBACK, name: str = "") -> None:
        self.name = name
        self.ranks = list(ranks)
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not in the {name or 'process'} group {self.ranks}")
        self.rank = rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        if self.world_size > 1 and (device_group is None or cpu_group is None):
            raise ValueError("a group of more than one rank needs a device_group and a cpu_group")
        self.device_group = device_group
        self.cpu_group = cpu_group
        self.backend = backend
        self.device = device if device is not None else torch.device("cpu")
        self.native_ops = native_ops

    @classmethod
    def single(cls, rank: int = 0, name: str = "") -> GroupCoordinator:
        """A group of `rank` alone; its collectives are the identity."""
        return cls([rank], rank, name=name)

    def __repr__(self) -> str:
        return (f"GroupCoordinator(name={self.name!r}, ranks={self.ranks}, "
                f"rank_in_group={self.rank_in_group}, backend={self.backend!r})")

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """The group rank after this one, wrapping around (the next pipeline stage)."""
        return (self.rank_in_group + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        """The group rank before this one, wrapping around (the previous pipeline stage)."""
        return (self.rank_in_group - 1) % self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group. `x` itself may hold the result: use the returned tensor."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim` in group-rank order (same shape on all)."""
        if self.world_size == 1:
            return x
        dim = _normalise_dim(dim, x)
        x = x.contiguous()
        if "all_gather" in self.native_ops:
            rows = x.new_empty((self.world_size * x.shape[0], *x.shape[1:]))
            _all_gather_single(rows, x, group=self.device_group)
            if dim == 0:
                return rows
            # [world, ..., n, ...] -> [..., world * n, ...] keeps rank order along `dim`.
            shape = (*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:])
            return rows.view(self.world_size, *x.shape).movedim(0, dim).reshape(shape)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows concatenated in group order, where rank i holds `counts[i]` rows
        (padded to the largest count for the collective, then cut back)."""
        if self.world_size == 1:
            return x
        if len(counts) != self.world_size or counts[self.rank_in_group] != x.shape[0]:
            raise ValueError(f"counts must give every rank's rows ({self.world_size} values, "
                             f"{x.shape[0]} for this rank), got {counts}")
        rows = max(counts)
        padded = x.new_zeros((rows, *x.shape[1:]))
        padded[:x.shape[0]] = x
        gathered = self.all_gather(padded, dim=0)
        return torch.cat([gathered[i * rows:i * rows + n] for i, n in enumerate(counts)])

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The sum over the group, then this rank's slice of it: the `rank_in_group`-th of
        `world_size` equal parts along `dim`. `x` is left unchanged."""
        if self.world_size == 1:
            return x
        dim = _normalise_dim(dim, x)
        if x.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter needs dim {dim} of size {x.shape[dim]} to divide "
                             f"into {self.world_size} equal parts")
        part = x.shape[dim] // self.world_size
        if "reduce_scatter" in self.native_ops:
            rows = x.movedim(dim, 0).contiguous()
            out = rows.new_empty((part, *rows.shape[1:]))
            _reduce_scatter_single(out, rows, group=self.device_group)
            return out.movedim(0, dim).contiguous()
        # Twice the traffic of a real reduce-scatter, but it needs nothing beyond all-reduce.
        total = self.all_reduce(x.clone(memory_format=torch.contiguous_format))
        return total.narrow(dim, self.rank_in_group * part, part).contiguous()

    def all_to_all(self, x: torch.Tensor, split_sizes: list[int] | None = None,
                   output_split_sizes: list[int] | None = None) -> torch.Tensor:
        """Rows of `x` (dim 0) scattered to the group: `split_sizes[j]` rows go to rank j, and
        the rows received are concatenated in sender order.

        `split_sizes=None` splits `x` evenly. `output_split_sizes` (rows from each rank) is
        exchanged when not given, which costs a small collective and a host sync; with both
        None every rank must pass the same number of rows, as in an even all-to-all.
        """
        if x.dim() == 0:
            raise ValueError("all_to_all needs a tensor with rows (dim 0), got a scalar")
        in_splits = self._check_splits(x, split_sizes, "split_sizes")
        if self.world_size == 1:
            if output_split_sizes is not None and list(output_split_sizes) != in_splits:
                raise ValueError("a group of one receives what it sends: output_split_sizes "
                                 f"must be {in_splits}, got {output_split_sizes}")
            return x
        x = x.contiguous()
        if output_split_sizes is not None:
            out_splits = self._check_splits(None, output_split_sizes, "output_split_sizes")
        elif split_sizes is None:
            out_splits = in_splits
        else:
            out_splits = self._exchange_split_sizes(in_splits, x.device)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        if "all_to_all" in self.native_ops:
            dist.all_to_all_single(out, x, out_splits, in_splits, group=self.device_group)
            return out
        return self._padded_all_to_all(x, in_splits, out_splits, out)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of group rank `src` on every rank (same shape and dtype on all); use the result."""
        self._check_peer(src, "src")
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        """Send `x` to group rank `dst`, which must `recv` the same shape and dtype."""
        self._check_point_to_point(dst, "dst")
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int,
             device: torch.device | None = None) -> torch.Tensor:
        """A tensor sent by group rank `src`; allocated on `device` (default: `self.device`)."""
        self._check_point_to_point(src, "src")
        out = torch.empty(tuple(shape), dtype=dtype,
                          device=device if device is not None else self.device)
        dist.recv(out, src=self.ranks[src], group=self.device_group)
        return out

    def isend(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Start sending `x` to group rank `dst` (which must receive the same shape and dtype)
        and return at once with the work handle. `wait()` on it before changing `x`: the
        handle keeps the tensor alive, not unchanged. Sends to one rank arrive in order."""
        self._check_point_to_point(dst, "dst")
        return dist.isend(x.contiguous(), dst=self.ranks[dst], group=self.device_group)

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object of group rank `src`, on every rank (others may pass None)."""
        self._check_peer(src, "src")
        if self.world_size == 1:
            return obj
        holder = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(holder, src=self.ranks[src], group=self.cpu_group)
        return holder[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in group order."""
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj, group=self.cpu_group)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)

    def _check_peer(self, peer: int, field: str) -> None:
        if not (isinstance(peer, int) and 0 <= peer < self.world_size):
            raise ValueError(f"`{field}` must be a rank in the group, in [0, {self.world_size}),"
                             f" got {peer!r}")

    def _check_point_to_point(self, peer: int, field: str) -> None:
        self._check_peer(peer, field)
        if peer == self.rank_in_group:
            raise ValueError(f"`{field}` must be another rank of the group, got this rank "
                             f"({peer}); send and recv need a group of at least two")

    def _check_splits(self, x: torch.Tensor | None, splits: list[int] | None,
                      field: str) -> list[int]:
        if splits is None:
            assert x is not None
            if x.shape[0] % self.world_size:
                raise ValueError(f"an even all_to_all needs dim 0 divisible by {self.world_size}"
                                 f" (the group size), got shape {tuple(x.shape)}; pass "
                                 "split_sizes")
            return [x.shape[0] // self.world_size] * self.world_size
        splits = [int(n) for n in splits]
        if len(splits) != self.world_size or min(splits) < 0:
            raise ValueError(f"`{field}` must be {self.world_size} (the group size) counts "
                             f">= 0, got {splits}")
        if x is not None and sum(splits) != x.shape[0]:
            raise ValueError(f"`{field}` must sum to the {x.shape[0]} rows of x, got {splits}")
        return splits

    def _exchange_split_sizes(self, in_splits: list[int], device: torch.device) -> list[int]:
        counts = torch.tensor(in_splits, dtype=torch.int64, device=device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.device_group)
        return received.tolist()

    def _padded_all_to_all(self, x: torch.Tensor, in_splits: list[int], out_splits: list[int],
                           out: torch.Tensor) -> torch.Tensor:
        # Every chunk padded to the largest chunk any rank sends turns the exchange into an
        # even all-to-all, which every backend has.
        largest = torch.tensor([max(in_splits)], dtype=torch.int64, device=x.device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.device_group)
        width = int(largest.item())
        if width == 0:
            return out
        padded = x.new_zeros((self.world_size * width, *x.shape[1:]))
        for peer, chunk in enumerate(x.split(in_splits)):
            padded[peer * width:peer * width + chunk.shape[0]] = chunk
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded, group=self.device_group)
        return torch.cat([received[peer * width:peer * width + n]
                          for peer, n in enumerate(out_splits)], out=out)


def _normalise_dim(dim: int, x: torch.Tensor) -> int:
    if x.dim() == 0 or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()

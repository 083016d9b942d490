"""The process groups of this process, built once from one `torch.distributed` world.

Before `init_distributed` (a single-process run) every accessor returns a group of one rank,
whose collectives are the identity, so layers call them unconditionally.
"""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from muse.distributed.config import ParallelConfig
from muse.distributed.group import GroupCoordinator
from muse.distributed.layout import GROUP_KINDS, group_ranks

BACKENDS = ("nccl", "gloo")
# The least time the ranks of a world wait for each other to join (see `_rendezvous`).
RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass
class _State:
    config: ParallelConfig
    groups: dict[str, GroupCoordinator]


_state: _State | None = None


def init_distributed(config: ParallelConfig, rank: int, init_method: str,
                     backend: str | None = None, local_rank: int | None = None,
                     timeout_s: float = 600) -> None:
    """Join the world of `config.world_size` processes as global `rank` and build every group.

    `backend` defaults to nccl when CUDA is available, gloo otherwise. Under nccl this process
    uses GPU `local_rank` (default: the LOCAL_RANK variable, else `rank`, i.e. one machine).
    """
    global _state
    if _state is not None:
        raise RuntimeError("init_distributed was already called; call destroy_distributed first")
    config.validate()
    config.coordinates(rank)  # rank in range
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"`backend` must be one of {BACKENDS}, got {backend!r}")
    device = _select_device(backend, rank, local_rank)
    timeout = timedelta(seconds=timeout_s)
    _restart_group_names()
    dist.init_process_group(backend, world_size=config.world_size, rank=rank, timeout=timeout,
                            **_rendezvous(init_method, rank, config.world_size, timeout_s))
    try:
        groups = _build_groups(config, rank, backend, device, timeout)
    except BaseException:
        dist.destroy_process_group()
        raise
    _state = _State(config=config, groups=groups)


def _rendezvous(init_method: str, rank: int, world_size: int, timeout_s: float
                ) -> dict[str, object]:
    """How the ranks find each other: for a tcp:// address, a TCPStore whose wait for the
    other ranks is at least RENDEZVOUS_TIMEOUT_S, whatever the collectives' timeout. A short
    `timeout_s` is there to notice a hung rank in a step; starting a rank (imports, loading
    weights) can take longer on a busy machine, and a rank that dies while starting is
    noticed by its process ending (`EngineCore._join_world`), not by this wait."""
    parsed = urllib.parse.urlparse(init_method)
    if parsed.scheme != "tcp":
        return {"init_method": init_method}
    store = dist.TCPStore(parsed.hostname, parsed.port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=max(timeout_s, RENDEZVOUS_TIMEOUT_S)))
    return {"store": store}


def _restart_group_names() -> None:
    """Number this world's process groups from 0, as a fresh process does.

    torch names a process group by a per-process counter that only a completed
    `destroy_process_group` resets, and the ranks of a world find each other's keys under
    those names. A rendezvous abandoned earlier in this process (the engine gives up on a
    world whose worker died while it formed) has already taken a name, so rank 0 would look
    for `2/...` while a fresh worker writes `0/...`, and both would wait until the timeout.
    With no world initialised, no group is alive, so restarting the count is safe."""
    world = getattr(dist.distributed_c10d, "_world", None)
    if not dist.is_initialized() and world is not None:
        world.group_count = 0


def _select_device(backend: str, rank: int, local_rank: int | None) -> torch.device:
    if backend == "gloo":
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise ValueError(f"`local_rank` must be a GPU index in [0, {count}) for nccl, "
                         f"got {local_rank}")
    # NCCL uses the current device; set it before any communicator exists.
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _build_groups(config: ParallelConfig, rank: int, backend: str, device: torch.device,
                  timeout: timedelta) -> dict[str, GroupCoordinator]:
    # Every rank creates every group of more than one rank, in the same order (torch needs
    # that, members or not). Kinds with the same membership (say TP and the world when only TP
    # is used) share one process group: each NCCL communicator holds GPU memory.
    created: dict[tuple[int, ...], tuple[Any, Any]] = {}
    groups = {}
    for kind in GROUP_KINDS:
        mine = None
        for ranks in group_ranks(config, kind):
            if len(ranks) == 1:
                continue  # size-1 groups need no process group
            key = tuple(ranks)
            if key not in created:
                created[key] = _new_groups(ranks, backend, timeout, config.world_size)
            if rank in ranks:
                mine = ranks
        if mine is None:
            groups[kind] = GroupCoordinator.single(rank, name=kind)
        else:
            device_group, cpu_group = created[tuple(mine)]
            groups[kind] = GroupCoordinator(mine, rank, device_group, cpu_group, backend,
                                            device, name=kind)
    return groups


def _new_groups(ranks: list[int], backend: str, timeout: timedelta,
                world_size: int) -> tuple[Any, Any]:
    if len(ranks) == world_size:
        device_group = dist.group.WORLD
    else:
        device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    if backend == "gloo":
        return device_group, device_group
    return device_group, dist.new_group(ranks, backend="gloo", timeout=timeout)


def is_initialized() -> bool:
    return _state is not None


def get_parallel_config() -> ParallelConfig:
    return _state.config if _state is not None else ParallelConfig()


def _group(kind: str) -> GroupCoordinator:
    if _state is None:
        return GroupCoordinator.single(name=kind)
    return _state.groups[kind]


def get_world_group() -> GroupCoordinator:
    return _group("world")


def get_tp_group() -> GroupCoordinator:
    return _group("tp")


def get_pp_group() -> GroupCoordinator:
    return _group("pp")


def get_dp_group() -> GroupCoordinator:
    return _group("dp")


def get_ep_group() -> GroupCoordinator:
    return _group("ep")


def get_pcp_group() -> GroupCoordinator:
    return _group("pcp")


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def destroy_distributed() -> None:
    """Tear down every group; a no-op when nothing was initialised."""
    global _state
    if _state is None:
        return
    _state = None
    if dist.is_initialized():
        dist.destroy_process_group()

"""The training processes: one, or torchrun's world (gloo on a CPU, NCCL on GPUs), and
the device and dtype each trains on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist



@dataclass(frozen=True)
class World:
    """This process's place among the training processes (one, or torchrun's)."""

    rank: int
    size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def agree(self, flag: bool) -> bool:
        """Whether any process says so (every process then takes the same branch: a time
        limit read from each one's clock must not split the world)."""
        if self.size == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


def resolve_device(name: str) -> torch.device:
    """`name`, with auto / cuda meaning this process's GPU (LOCAL_RANK under torchrun)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def init_world(device_name: str) -> World:
    """Join torchrun's world when it has more than one process (gloo on a CPU, nccl on
    GPUs); a world already initialised by the caller is used as it is."""
    device = resolve_device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), device)
    return World(0, 1, device)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def all_reduce_values(values: list[float], world: World, op: Any = None) -> list[float]:
    """`values` summed (or reduced by `op`) over the processes."""
    if world.size == 1:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op)
    return tensor.tolist()

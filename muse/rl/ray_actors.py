"""`muse train grpo --ray`: the trainer and the rollout engine as two Ray actors.

The driver runs the same `GRPOLoop` as a colocated run; its trainer and rollouts are handles
whose method calls run in the actors and wait for their results. The adapter goes from the
trainer actor to the engine actor through Ray's object store (host tensors, no files), and
trajectories come back the same way. On a GPU both actors take half of one GPU (the
colocated layout); on a CPU one CPU each. Ray joins the cluster this process can find
(RAY_ADDRESS, or one started with `ray start`), else starts a local one.

FSDP2 over several processes is torchrun's (one trainer per process), not this mode's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from muse.rl.policy_trainer import PolicyTrainer
from muse.rl.rollout_worker import RolloutWorker
from muse.rl.trainer import GRPOLoop
from muse.rl.world import World, resolve_device
from muse.rl.trainer_options import GRPOTrainArgs


def require_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError("muse train grpo --ray needs Ray: pip install 'muse[ray]'") \
            from error
    return ray


def _join_import_path(path: list[str]) -> None:
    """The driver's import path, so rewards named "module:function" import the same here."""
    sys.path[:0] = [entry for entry in path if entry not in sys.path]


def _actor_device(args: GRPOTrainArgs) -> torch.device:
    # Ray shows an actor only the GPU it was given, as cuda:0.
    return torch.device("cuda", 0) if resolve_device(args.device).type == "cuda" \
        else torch.device("cpu")


class TrainerActor:
    """The policy and its optimiser (one process, no FSDP)."""

    def __init__(self, args: GRPOTrainArgs, import_path: list[str]) -> None:
        _join_import_path(import_path)
        self.trainer = PolicyTrainer(args, World(0, 1, _actor_device(args)))

    def adapter(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        config, tensors = self.trainer.adapter()
        return config, {name: tensor.cpu() for name, tensor in tensors.items()}

    def train(self, groups: list) -> dict[str, float]:
        return self.trainer.train(groups)

    def save(self, directory: str) -> None:
        self.trainer.save(directory)


class RolloutActor:
    """The engine serving the adapter versions the driver hands over."""

    def __init__(self, args: GRPOTrainArgs, import_path: list[str]) -> None:
        _join_import_path(import_path)
        self.worker = RolloutWorker(args, _actor_device(args))

    def sync(self, config: dict[str, Any], tensors: dict[str, torch.Tensor],
             version: int) -> None:
        self.worker.sync(config, tensors, version)

    def rollout(self, tasks: list[dict[str, Any]], group_size: int, seed: int,
                temperature: float) -> list:
        return self.worker.rollout(tasks, group_size, seed, temperature)


class RemoteCalls:
    """An actor seen as a local object: `handle.method(...)` runs `method` in the actor and
    returns its result."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def __getattr__(self, name: str) -> Any:
        ray = require_ray()
        method = getattr(self._actor, name)
        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))


def train_with_ray(args: GRPOTrainArgs) -> Path:
    """The whole run with the trainer and the engine as Ray actors; returns the output."""
    ray = require_ray()
    from muse.engine.ray_workers import connect

    connect()
    on_gpu = resolve_device(args.device).type == "cuda"
    resources = {"num_gpus": 0.5, "num_cpus": 0} if on_gpu else {"num_gpus": 0, "num_cpus": 1}
    import_path = list(sys.path)
    trainer = ray.remote(TrainerActor).options(**resources).remote(args, import_path)
    rollouts = ray.remote(RolloutActor).options(**resources).remote(args, import_path)
    try:
        return GRPOLoop(args, RemoteCalls(trainer), RemoteCalls(rollouts),
                        World(0, 1, torch.device("cpu"))).run()
    finally:
        ray.kill(trainer, no_restart=True)
        ray.kill(rollouts, no_restart=True)

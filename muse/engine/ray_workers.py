"""The `ray` executor backend: ranks 1..N-1 as Ray actors, rank 0 in this process.

This process (the driver) stays rank 0 and keeps the scheduler, the sampler and its own
shard; Ray only places and runs the other ranks. A placement group reserves one bundle per
worker rank ({"GPU": 1} on CUDA, else {"CPU": 1}), packed on as few nodes as possible, and one
actor per bundle runs `run_worker` for as long as the engine lives.

What crosses which boundary:
- driver -> actor, once, through Ray: the rank, the `EngineArgs` and the rendezvous address
  (tcp://<driver node ip>:<port>); each actor builds its own shard of the model from them.
- driver <-> actors, every step: nothing through Ray. Steps go over the torch.distributed
  world (gloo on CPU, NCCL on GPU) exactly as with the `mp` backend.
- actor -> driver, at the end: whether `run` returned or raised (the handle's `exitcode`).

A GPU actor sees only the GPU Ray gave it (Ray sets CUDA_VISIBLE_DEVICES), so it runs on
cuda:0. Ray does not know about the GPU the driver itself uses: an actor that Ray puts on that
same GPU is refused with an error saying how to keep it out of Ray's hands.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from muse.engine.args import EngineArgs
from muse.engine.executor import free_init_method

logger = logging.getLogger("muse.engine")
# How long to wait for the cluster to have room for every worker rank.
PLACEMENT_TIMEOUT_S = 60.0


class _RankActor:
    """One worker rank, inside a Ray actor process."""

    def __init__(self) -> None:
        import ray

        # Ray gives the actor its CPUs (one on CPU, none on GPU): as many threads, at least 1.
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(max(1, int(cpus)))

    def describe(self) -> tuple[int, str, str | None]:
        """(pid, Ray node id, the GPU Ray gave this actor or None)."""
        import ray

        return (os.getpid(), ray.get_runtime_context().get_node_id(),
                os.environ.get("CUDA_VISIBLE_DEVICES") if ray.get_gpu_ids() else None)

    def run(self, rank: int, args: EngineArgs, init_method: str) -> None:
        from muse.engine.worker_main import run_worker

        device = torch.device("cuda", 0) if args.resolve_device().type == "cuda" \
            else torch.device("cpu")
        run_worker(rank, args, init_method, device)


class RayWorkerHandle:
    """A worker rank's actor, seen as a process (`muse.engine.executor.WorkerProcess`): alive
    while its `run` call has not finished."""

    def __init__(self, actor: Any, run_ref: Any, pid: int) -> None:
        self.actor = actor
        self.run_ref = run_ref
        self.pid = pid  # on the actor's node, which may not be this one
        self._exitcode: int | None = None

    def is_alive(self) -> bool:
        import ray

        if self._exitcode is not None:
            return False
        done, _ = ray.wait([self.run_ref], timeout=0)
        if not done:
            return True
        try:
            ray.get(self.run_ref)
            self._exitcode = 0
        except Exception:  # the rank raised, or its actor died
            self._exitcode = 1
        return False

    @property
    def exitcode(self) -> int | None:
        self.is_alive()
        return self._exitcode

    def join(self, timeout: float | None = None) -> None:
        import ray

        ray.wait([self.run_ref], timeout=timeout)
        self.is_alive()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


class RayWorkers:
    """The actors of ranks 1..N-1 and the placement group that holds their resources."""

    def __init__(self, init_method: str, handles: list[RayWorkerHandle],
                 placement_group: Any) -> None:
        self.init_method = init_method
        self.handles = handles
        self.placement_group = placement_group

    def shutdown(self) -> None:
        """End every actor and give their resources back (safe to call again)."""
        from ray.util.placement_group import remove_placement_group

        if self.placement_group is None:
            return
        for handle in self.handles:
            handle.kill()
        remove_placement_group(self.placement_group)
        self.placement_group = None


def connect() -> None:
    """Join the Ray cluster this process can find (RAY_ADDRESS, else the latest one started
    on this machine with `ray start`); only if there is none, start a local instance. Like
    vLLM, an existing cluster comes first: its nodes are the point of this backend."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"))
    except ConnectionError:
        logger.info("no Ray cluster found: starting a local Ray instance")
        ray.init(include_dashboard=False)


def start_ray_workers(args: EngineArgs, world_size: int) -> RayWorkers:
    """Place and start ranks 1..world_size-1; they wait for rank 0 at `init_method`."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connect()
    on_gpu = args.resolve_device().type == "cuda"
    resource = "GPU" if on_gpu else "CPU"
    count = world_size - 1
    group = placement_group([{resource: 1}] * count, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster could not place {count} worker rank(s) within "
            f"{PLACEMENT_TIMEOUT_S:.0f} s: they need {count} {resource}s, one each (rank 0 uses "
            f"this process's device besides); the cluster has "
            f"{ray.available_resources().get(resource, 0):g} free of "
            f"{ray.cluster_resources().get(resource, 0):g}")

    actor_class = ray.remote(_RankActor)
    actors = [actor_class.options(
        num_gpus=1 if on_gpu else 0, num_cpus=0 if on_gpu else 1,
        max_restarts=0, max_task_retries=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index)).remote()
        for index in range(count)]
    try:
        described = ray.get([actor.describe.remote() for actor in actors])
        if on_gpu:
            _check_driver_gpu_free(args, described)
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)
        raise

    init_method = free_init_method(ray.util.get_node_ip_address())
    handles = [RayWorkerHandle(actor, actor.run.remote(rank, args, init_method), pid)
               for rank, (actor, (pid, _, _)) in enumerate(zip(actors, described), start=1)]
    return RayWorkers(init_method, handles, group)


def _check_driver_gpu_free(args: EngineArgs, described: list[tuple[int, str, str | None]]
                           ) -> None:
    """Refuse an actor that Ray put on the driver's own GPU (Ray does not count that one)."""
    import ray

    index = args.resolve_device().index or 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    driver_gpu = visible.split(",")[index].strip() if visible else str(index)
    node = ray.get_runtime_context().get_node_id()
    for rank, (_, actor_node, gpu) in enumerate(described, start=1):
        if actor_node == node and gpu == driver_gpu:
            raise RuntimeError(
                f"Ray placed rank {rank} on GPU {gpu}, which this process (rank 0) uses: Ray "
                "does not know about the driver's GPU. Start Ray on this node without it (e.g. "
                f"CUDA_VISIBLE_DEVICES=<the other GPUs> ray start ...), or pick another "
                "`device` for rank 0")

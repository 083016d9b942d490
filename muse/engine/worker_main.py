"""The entry point of a worker process (ranks 1..N-1 of the multiprocess executor).

It joins the world, builds its shard of the model the same way rank 0 does, allocates its KV
tensors for the block counts rank 0 decided, then runs each step rank 0 broadcasts until told
to stop. It exits when the driver goes away.
"""

from __future__ import annotations

import logging

import torch

from muse.engine.args import EngineArgs

logger = logging.getLogger("muse.engine")


def run_worker(rank: int, args: EngineArgs, init_method: str,
               device: torch.device | None = None) -> None:
    """Run rank `rank` until the driver says stop. `device` defaults to the rank's own
    (`EngineArgs.rank_device`); a Ray actor, which sees only its own GPU, passes cuda:0."""
    from muse.distributed.parallel_state import (destroy_distributed, get_dp_group,
                                                 get_world_group, init_distributed)
    from muse.engine.engine import load_engine_model
    from muse.engine.executor import KEEPALIVE
    from muse.engine.rank_memory import shared_kv_budget
    from muse.engine.runner import allocate_kv_caches
    from muse.engine.metadata import build_host_batch
    from muse.engine.step_message import RequestMirror, decode_delta
    from muse.engine.worker import ModelWorker

    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(name)s: %(message)s")
    device = device if device is not None else args.rank_device(rank)
    init_distributed(args.parallel_config(), rank, init_method,
                     backend="nccl" if device.type == "cuda" else "gloo",
                     local_rank=device.index, timeout_s=args.distributed_timeout_s)
    world = get_world_group()
    try:
        _, model, dtype = load_engine_model(args, device)
        shared_kv_budget(model.eval(), args, device, dtype)
        num_blocks = world.broadcast_object(None, src=0)
        kv_caches = allocate_kv_caches(model, num_blocks, args.block_size,
                                       args.resolve_kv_cache_dtype(dtype), device)
        worker = ModelWorker(model.eval(), kv_caches, device, args.block_size)
        if args.calculate_kv_scales:
            model.calculate_kv_scales_on_next_step()  # from this rank's first step, as rank 0
        # This rank's data-parallel rank's requests, as the driver's deltas describe them.
        kinds = list(num_blocks)
        mirror = RequestMirror(kinds)
        dp_rank = get_dp_group().rank_in_group
        while (message := world.broadcast_object(None, src=0)) is not None:
            if message == KEEPALIVE:
                continue
            delta = message.deltas[dp_rank]
            batch = None if delta is None else build_host_batch(
                kinds, args.block_size, model.config.sliding_window,
                mirror.apply(decode_delta(delta)))
            worker.execute_data_parallel(batch, message.num_tokens, message.logits_rows)
    finally:
        destroy_distributed()

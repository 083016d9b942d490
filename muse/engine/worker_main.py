"""The entry point of a worker process (ranks 1..N-1 of the multiprocess executor).

It joins the world, builds its shard of the model the same way rank 0 does (and a copy of the
media encoders, when the model has them), allocates its KV tensors for the block counts rank 0
decided, then runs each step rank 0 broadcasts until told to stop. It exits when the driver
goes away.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from muse.engine.args import EngineArgs

if TYPE_CHECKING:
    from muse.config import MuseSparkConfig
    from muse.model.decoder import EngineModel
    from muse.multimodal.engine_inputs import MediaEncoders

logger = logging.getLogger("muse.engine")


def run_worker(rank: int, args: EngineArgs, init_method: str,
               device: torch.device | None = None) -> None:
    """Run rank `rank` until the driver says stop. `device` defaults to the rank's own
    (`EngineArgs.rank_device`); a Ray actor, which sees only its own GPU, passes cuda:0."""
    from muse.distributed.parallel_state import (destroy_distributed, get_dp_group,
                                                 get_parallel_config, get_world_group,
                                                 init_distributed)
    from muse.engine.engine import load_engine_model
    from muse.engine.executor import KEEPALIVE
    from muse.engine.rank_memory import shared_kv_budget
    from muse.engine.runner import allocate_kv_caches
    from muse.engine.metadata import build_host_batch
    from muse.engine.host_kv_store import HostKVStore
    from muse.engine.kv_offload import disk_tier_root, shard_name
    from muse.engine.step_message import RequestMirror, decode_delta
    from muse.engine.worker import ModelWorker
    from muse.multimodal.encoder_cache import EncoderCache

    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(name)s: %(message)s")
    device = device if device is not None else args.rank_device(rank)
    init_distributed(args.parallel_config(), rank, init_method,
                     backend="nccl" if device.type == "cuda" else "gloo",
                     local_rank=device.index, timeout_s=args.distributed_timeout_s)
    world = get_world_group()
    try:
        model_config, model, dtype = load_engine_model(args, device)
        # Built before the memory profile, as on the driver, so the KV budgets agree.
        encoders = worker_media_encoders(args, model_config, model, dtype, device)
        shared_kv_budget(model.eval(), args, device, dtype)
        num_blocks, host_blocks = world.broadcast_object(None, src=0)
        kv_dtype = args.resolve_kv_cache_dtype(dtype)
        kv_caches = allocate_kv_caches(model, num_blocks, args.block_size, kv_dtype, device)
        host_store = None
        if host_blocks:
            me = get_parallel_config().coordinates(rank)
            host_store = HostKVStore(model.layer_types, kv_caches, host_blocks,
                                     disk_tier_root(args, kv_dtype)
                                     if args.kv_offload_disk is not None else None,
                                     shard_name(me.pp, me.tp))
        from muse.disagg.encoder_connector import ECTransferConfig, connected_encoders

        worker = ModelWorker(model.eval(), kv_caches, device, args.block_size,
                             encoders=connected_encoders(
                                 encoders, ECTransferConfig.parse(args.ec_transfer_config),
                                 args.model, args.seed, dtype, device),
                             encoder_cache=EncoderCache(args.encoder_cache_bytes)
                             if encoders is not None else None, host_store=host_store)
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
            batch = None
            if delta is not None:
                step = decode_delta(delta)
                batch = build_host_batch(kinds, args.block_size, model.config.sliding_window,
                                         mirror.apply(step))
                batch.media = mirror.step_media(step)
                batch.kv_transfers = step.transfers
            worker.execute_data_parallel(batch, message.num_tokens, message.logits_rows)
    finally:
        destroy_distributed()


def worker_media_encoders(args: EngineArgs, model_config: MuseSparkConfig,
                          model: EngineModel, dtype: torch.dtype, device: torch.device
                          ) -> MediaEncoders | None:
    """This rank's copy of the vision / audio encoders, replicated (they are small): the
    preset's drawn from the engine's seed, so every rank gets the driver's weights, or the
    checkpoint's. None without encoders, and on a pipeline stage after the first, which never
    reads embeddings."""
    from muse.multimodal.engine_inputs import build_media_encoders, load_media_encoders
    from muse.presets import PRESETS

    if not model.is_first_stage:
        return None
    if args.model in PRESETS:
        return build_media_encoders(model_config, args.seed, dtype, device)
    return load_media_encoders(model_config, args.model, dtype, device)

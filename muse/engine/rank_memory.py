"""The KV cache budget of a world of ranks: each rank measures its own, all take the smallest.

On a GPU a rank's budget is what is left under `gpu_memory_utilization` once its weights are
loaded and the largest step (`max_num_batched_tokens` tokens) has run once: that profile run
measures the activations' peak, which the KV cache must leave free. Ranks differ (another
shard, another card's free memory); every rank holds the same block counts, so the smallest
budget decides. Every rank calls `shared_kv_budget` at the same point, since the profile run
makes the model's collectives.
"""

from __future__ import annotations

import torch

from muse.engine.args import EngineArgs
from muse.engine.kv_budget import CPU_DEFAULT_KV_BYTES
from muse.model.decoder import EngineModel


def shared_kv_budget(model: EngineModel, args: EngineArgs, device: torch.device,
                     dtype: torch.dtype) -> int:
    """KV bytes per rank that every rank of the world can hold."""
    from muse.distributed.parallel_state import get_world_group

    return min(get_world_group().all_gather_object(rank_kv_budget(model, args, device, dtype)))


def rank_kv_budget(model: EngineModel, args: EngineArgs, device: torch.device,
                   dtype: torch.dtype) -> int:
    """An explicit budget; on the CPU a fixed one; on a GPU what the profile run leaves."""
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    activations = profile_activation_bytes(model, args, device, dtype)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return max(0, int(total * args.gpu_memory_utilization) - (total - free) - activations)


@torch.inference_mode()
def profile_activation_bytes(model: EngineModel, args: EngineArgs, device: torch.device,
                             dtype: torch.dtype) -> int:
    """Peak memory of one step of `max_num_batched_tokens` prompt tokens beyond the weights
    (its K/V goes to a one-block cache; attention reads that block for every position)."""
    from muse.engine.metadata import HostBatch
    from muse.engine.runner import allocate_kv_caches
    from muse.engine.worker import ModelWorker

    kinds = list(dict.fromkeys(model.config.layer_types))
    kv_caches = allocate_kv_caches(model, {kind: 1 for kind in kinds}, args.block_size,
                                   args.resolve_kv_cache_dtype(dtype), device)
    worker = ModelWorker(model, kv_caches, device, args.block_size)
    tokens = args.max_num_batched_tokens
    batch = HostBatch.dummy(kinds, tokens, args.block_size)
    # Every data-parallel rank runs the same step, and each wants logits for its sequences.
    rows = list(range(tokens - min(tokens, args.max_num_seqs), tokens))
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    worker.execute_data_parallel(batch, [tokens] * args.data_parallel_size,
                                 [rows] * args.data_parallel_size)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before

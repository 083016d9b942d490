"""A rank's KV budget: explicit, a fixed default on the CPU, and on a GPU what the profile run
of the largest step leaves under `gpu_memory_utilization`."""

from __future__ import annotations

import pytest
import torch

from muse.engine.args import EngineArgs
from muse.engine.engine import load_engine_model
from muse.engine.kv_budget import CPU_DEFAULT_KV_BYTES
from muse.engine.rank_memory import (profile_activation_bytes, rank_kv_budget,
                                     shared_kv_budget)


def test_explicit_and_cpu_budgets():
    args = EngineArgs(model="muse-spark-tiny", device="cpu", kv_cache_memory_bytes=12345)
    _, model, dtype = load_engine_model(args, torch.device("cpu"))
    assert rank_kv_budget(model, args, torch.device("cpu"), dtype) == 12345
    # One process: the world is this rank alone.
    assert shared_kv_budget(model, args, torch.device("cpu"), dtype) == 12345
    args.kv_cache_memory_bytes = None
    assert rank_kv_budget(model, args, torch.device("cpu"), dtype) == CPU_DEFAULT_KV_BYTES


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the profile run measures a GPU")
def test_the_profile_run_grows_with_the_step_and_shrinks_the_budget():
    device = torch.device("cuda")
    small = EngineArgs(model="muse-spark-tiny", max_num_batched_tokens=256)
    large = EngineArgs(model="muse-spark-tiny", max_num_batched_tokens=8192)
    _, model, dtype = load_engine_model(small, device)
    model.eval()
    peaks = [profile_activation_bytes(model, args, device, dtype) for args in (small, large)]
    assert 0 < peaks[0] < peaks[1]
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    naive = int(total * large.gpu_memory_utilization) - (total - free)
    assert rank_kv_budget(model, large, device, dtype) <= naive - peaks[1] + 2**20

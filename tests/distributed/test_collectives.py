"""Every collective on gloo worlds of 2 and 4 processes (and NCCL where there are enough GPUs)
against the same computation in one process; groups of one rank without any initialisation."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from muse.distributed import parallel_state as ps
from muse.distributed.config import ParallelConfig
from muse.distributed.launch import spawn_workers
from tests.distributed import workers


def _backends(world_size: int) -> list[str]:
    # NCCL runs only where each rank has its own GPU; gloo runs everywhere.
    return ["gloo"] + (["nccl"] if torch.cuda.device_count() >= world_size else [])


def _assert_checks(results: list[list[workers.Check]], min_checks: int) -> None:
    for rank, checks in enumerate(results):
        assert len(checks) >= min_checks, f"rank {rank} ran only {len(checks)} checks"
        for check in checks:
            message = f"rank {rank}: {check.name}"
            if isinstance(check.expected, torch.Tensor):
                assert check.actual.shape == check.expected.shape, message
                tolerance = {"rtol": 0, "atol": 0} if check.exact else {}
                torch.testing.assert_close(check.actual, check.expected, **tolerance,
                                           msg=message)
            else:
                assert check.actual == check.expected, message


@pytest.mark.parametrize("backend", _backends(2))
def test_world_of_two_data_parallel_with_experts(backend: str) -> None:
    # DP and EP are both the whole world here, so they share the default group.
    config = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    results = spawn_workers(workers.collective_checks, config, args=(1,), backend=backend,
                            timeout_s=120)
    _assert_checks(results, min_checks=200)


@pytest.mark.parametrize("backend", _backends(4))
def test_world_of_four_tensor_and_pipeline(backend: str) -> None:
    # TP groups [0, 1] and [2, 3] (EP the same ranks), PP groups [0, 2] and [1, 3].
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                            enable_expert_parallel=True)
    results = spawn_workers(workers.collective_checks, config, args=(2,), backend=backend,
                            timeout_s=120)
    _assert_checks(results, min_checks=200)
    names = {check.name for check in results[2]}
    assert "pp recv from next stage" not in names  # rank 2 is the last stage
    assert "pp recv from previous stage" in names


def test_failing_rank_raises_its_traceback_and_no_worker_survives() -> None:
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed") as error:
        spawn_workers(workers.fail_on_rank_one, ParallelConfig(data_parallel_size=2),
                      backend="gloo", timeout_s=60)
    assert "ValueError: rank one fails on purpose" in str(error.value)
    assert time.monotonic() - started < 30  # rank 0, blocked in a barrier, was killed
    assert multiprocessing.active_children() == []


def test_timeout_kills_every_worker() -> None:
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish"):
        spawn_workers(workers.sleep_then_return, ParallelConfig(tensor_parallel_size=2),
                      args=(60,), backend="gloo", timeout_s=0.5)
    assert multiprocessing.active_children() == []


def test_size_one_groups_are_identities_without_init() -> None:
    assert not ps.is_initialized()
    assert ps.get_parallel_config() == ParallelConfig()
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_tensor_model_parallel_world_size() == 1
    x = torch.randn(4, 6)
    for get in (ps.get_world_group, ps.get_tp_group, ps.get_pp_group, ps.get_dp_group,
                ps.get_ep_group, ps.get_pcp_group):
        group = get()
        assert (group.ranks, group.rank_in_group, group.world_size) == ([0], 0, 1)
        assert group.is_first_rank and group.is_last_rank
        assert group.all_reduce(x) is x
        assert group.all_gather(x, dim=0) is x
        assert group.reduce_scatter(x, dim=1) is x
        assert group.all_to_all(x, [4], [4]) is x
        assert group.broadcast(x, src=0) is x
        assert group.broadcast_object({"a": 1}) == {"a": 1}
        group.barrier()
        with pytest.raises(ValueError, match="at least two"):
            group.send(x, dst=0)
        with pytest.raises(ValueError, match="at least two"):
            group.recv((4, 6), torch.float32, src=0)
        with pytest.raises(ValueError, match="`src` must be a rank in the group"):
            group.broadcast(x, src=1)
    assert not torch.distributed.is_initialized()

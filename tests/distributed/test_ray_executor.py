"""The `ray` executor backend on CPU (gloo): ranks 1..N-1 as Ray actors give the same greedy
tokens as the one-process engine, a killed actor fails the next step instead of hanging, with
nothing left running after shutdown, and worlds Ray cannot place well are refused."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

ray = pytest.importorskip("ray")

from muse import LLM, SamplingParams  # noqa: E402
from muse.engine.executor import WorkerError  # noqa: E402
from tests.distributed.test_parallel_engine import MAX_TOKENS, run  # noqa: E402
from tests.engine.helpers import MIN_GREEDY_GAP, mixed_prompts, reference_greedy  # noqa: E402

CLUSTER_CPUS = 4
# Long enough for ranks to meet on a busy 2-core machine; a dead rank is noticed well before.
TIMEOUT_S = 60.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster() -> Iterator[None]:
    """A private one-node Ray cluster, started by this process and gone with the module.

    In-process (`address="local"`) rather than `ray start` in a subprocess: it takes ~3 s on a
    2-core machine, ignores any RAY_ADDRESS or cluster already running here, and
    `ray.shutdown()` ends exactly its processes, where `ray stop` would end every Ray process
    of this user on the machine. The engine finds it connected and uses it.
    """
    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=True)
    try:
        yield
    finally:
        ray.shutdown()


def all_cpus_free(wait_s: float = 30) -> bool:
    """Whether the cluster's CPUs are all free again (Ray reports a release a moment late)."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU") != CLUSTER_CPUS:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_ray_ranks_give_the_one_process_greedy_tokens():
    from muse.presets import get_preset
    from muse.reference.model import MuseForCausalLM

    reference = MuseForCausalLM(get_preset("muse-spark-tiny").text_config)
    reference.init_weights(0, 0.1)
    prompts = mixed_prompts(reference.config.vocab_size, reference.config.sliding_window or 16,
                            count=12)
    _, gap = reference_greedy(reference.eval(), prompts, MAX_TOKENS)
    assert gap > MIN_GREEDY_GAP  # an argmax that rounding cannot flip
    want, one_process = run("muse-spark-tiny", prompts, init_std=0.1)

    # Room for ~200 tokens in a one-process run (each of the 2 ranks holds 1 of the 2 K/V
    # heads): chunked prefill, prefix-cache hits and preemptions all happen.
    got, stats = run("muse-spark-tiny", prompts, init_std=0.1, tensor_parallel_size=2,
                     distributed_executor_backend="ray",
                     kv_cache_memory_bytes=100 * one_process["token_bytes"])
    assert got == want
    assert sum(stats["hits"]) > 0 and sum(stats["preemptions"]) > 0  # per replica
    assert all_cpus_free()  # the actor's CPU came back


# 4 ranks where the actor is killed through Ray: the 2 survivors must be ended too. 2 ranks
# (quicker to start) where its process dies under Ray, as in a crash or under the OOM killer.
@pytest.mark.parametrize(("how", "tensor_parallel_size"), [("ray.kill", 4), ("SIGKILL", 2)])
def test_a_killed_actor_fails_the_step_and_shutdown_ends_the_rest(how, tensor_parallel_size):
    llm = LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
              tensor_parallel_size=tensor_parallel_size, distributed_executor_backend="ray",
              distributed_timeout_s=TIMEOUT_S)
    handles = llm.engine.runner.executor.processes
    try:
        assert len(handles) == tensor_parallel_size - 1
        assert all(h.is_alive() and h.exitcode is None for h in handles)
        first = llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids
        assert len(first) == PARAMS.max_tokens
        if how == "ray.kill":
            handles[0].kill()
        else:
            os.kill(handles[0].pid, signal.SIGKILL)
        start = time.monotonic()
        # Ray normally reports the death at once ("rank 1 exited"); on a loaded machine it
        # may come after the executor's grace period, which then names the failed collective.
        with pytest.raises(WorkerError, match="rank 1 exited with code 1|hung or crashed"):
            llm.generate([[5, 6, 7]], PARAMS)
        assert time.monotonic() - start < TIMEOUT_S / 4  # a death, not the world's timeout
    finally:
        llm.shutdown()
    llm.engine.runner.executor.on_shutdown()  # again (`RayWorkers.shutdown`): a no-op
    assert handles[0].exitcode == 1
    for handle in handles:
        assert not handle.is_alive() and handle.exitcode is not None
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.actor.describe.remote(), timeout=30)
    assert all_cpus_free()  # the placement group is gone


def test_a_world_the_cluster_cannot_hold_is_refused(monkeypatch):
    from muse.engine import ray_workers
    from muse.engine.args import EngineArgs

    monkeypatch.setattr(ray_workers, "PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match="they need 7 CPUs, one each.* 4 free of 4"):
        ray_workers.start_ray_workers(EngineArgs(device="cpu"), world_size=8)
    assert all_cpus_free()  # the half-placed group was removed


def test_an_actor_on_the_drivers_own_gpu_is_refused(monkeypatch):
    from muse.engine.args import EngineArgs
    from muse.engine.ray_workers import _check_driver_gpu_free

    here = ray.get_runtime_context().get_node_id()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(RuntimeError, match="rank 2 on GPU 0, which this process"):
        _check_driver_gpu_free(EngineArgs(device="cuda"), [(1, here, "1"), (2, here, "0")])
    _check_driver_gpu_free(EngineArgs(device="cuda:1"), [(1, here, "0")])
    _check_driver_gpu_free(EngineArgs(device="cuda"), [(1, "another node", "0")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0")  # this process's cuda:1 is GPU 0
    with pytest.raises(RuntimeError, match="rank 1 on GPU 0"):
        _check_driver_gpu_free(EngineArgs(device="cuda:1"), [(1, here, "0")])

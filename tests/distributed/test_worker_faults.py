"""Worker ranks of the multiprocess executor: an idle engine keeps them, a hung one is noticed
within the world's timeout, and either way nothing is left running."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from muse import LLM, SamplingParams
from muse.engine.executor import WorkerError

TIMEOUT_S = 3.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def two_ranks() -> LLM:
    return LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
               tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S)


def test_an_idle_engine_keeps_its_workers():
    llm = two_ranks()
    try:
        first = llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids
        time.sleep(2.5 * TIMEOUT_S)  # longer than a collective may wait
        assert llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids == first
    finally:
        llm.shutdown()


def test_a_hung_worker_fails_the_step_within_the_timeout():
    llm = two_ranks()
    worker = llm.engine.runner.executor.processes[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match="hung or crashed"):
            llm.generate([[5, 6, 7]], PARAMS)
        assert time.monotonic() - start < 4 * TIMEOUT_S
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        llm.shutdown()
    assert not worker.is_alive()


def test_a_worker_that_dies_while_starting_fails_the_engine_at_once():
    """Killed as soon as it exists: rank 0 is waiting for it to join the world (or already in
    a collective with it) and must fail within seconds, not the world's timeout, leaving no
    process behind."""
    killer = threading.Thread(target=_kill_first_child, daemon=True)
    killer.start()
    start = time.monotonic()
    with pytest.raises((WorkerError, RuntimeError)):
        LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
            tensor_parallel_size=2, distributed_timeout_s=120)
    assert time.monotonic() - start < 60
    killer.join()
    assert multiprocessing.active_children() == []


def _kill_first_child() -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in multiprocessing.active_children():
            if child.name.startswith("muse-worker"):
                os.kill(child.pid, signal.SIGKILL)
                return
        time.sleep(0.01)


def test_a_world_forms_after_an_abandoned_rendezvous_in_this_process():
    """An abandoned rendezvous (as when a worker dies while the world forms) has already
    taken a process-group name in this process; the next world must still find its fresh
    worker's keys instead of waiting out the timeout."""
    import torch.distributed as dist

    dist.distributed_c10d._world.group_count = 2  # what two abandoned rendezvous leave
    llm = two_ranks()
    try:
        assert len(llm.generate([[5, 6, 7]], PARAMS)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()

"""Run a function on every rank of a parallel config, one spawned process per rank, on one
machine: for tests and executors.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import threading
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from muse.distributed.config import ParallelConfig
from muse.distributed.parallel_state import destroy_distributed, get_world_group, init_distributed

_POLL_S = 0.05
_PARENT_CHECK_S = 1.0
_EXIT_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_workers(fn: Callable[..., Any], config: ParallelConfig, args: tuple = (),
                  backend: str | None = None, timeout_s: float = 300) -> list[Any]:
    """`fn(rank, *args)` in `config.world_size` fresh processes, each inside its distributed
    world (`init_distributed` before, `destroy_distributed` after); the results in rank order.

    `fn`, `args` and the results must pickle (`fn` a module-level function); return CPU
    values. If a worker raises, dies or the whole run outlasts `timeout_s`, every worker still
    running is killed and a RuntimeError (TimeoutError for the timeout) carries the failing
    rank's traceback.
    """
    config.validate()
    context = mp.get_context("spawn")
    results: Any = context.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    processes = [context.Process(target=_worker, name=f"muse-rank-{rank}",
                                 args=(fn, config, rank, init_method, backend, args, results,
                                       os.getpid()))
                 for rank in range(config.world_size)]
    try:
        for process in processes:
            process.start()
        outputs = _collect(processes, results, timeout_s)
        # Ranks that all succeeded leave their groups together; let them before killing.
        deadline = time.monotonic() + _EXIT_GRACE_S
        for process in processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        return outputs
    finally:
        _stop(processes)
        results.close()
        results.join_thread()


def _collect(processes: list[Any], results: Any, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    outputs: dict[int, Any] = {}
    while len(outputs) < len(processes):
        try:
            _take(results.get(timeout=_POLL_S), outputs)
            continue
        except queue.Empty:
            pass
        for rank, process in enumerate(processes):
            if rank not in outputs and process.exitcode is not None:
                _take_last_words(rank, process, results, outputs)
        if time.monotonic() > deadline:
            pending = [rank for rank in range(len(processes)) if rank not in outputs]
            raise TimeoutError(f"ranks {pending} did not finish within {timeout_s} s")
    return [outputs[rank] for rank in range(len(processes))]


def _take(message: tuple[int, bool, Any], outputs: dict[int, Any]) -> None:
    rank, ok, payload = message
    if not ok:
        raise RuntimeError(f"rank {rank} failed:\n{payload}")
    outputs[rank] = pickle.loads(payload)


def _take_last_words(rank: int, process: Any, results: Any, outputs: dict[int, Any]) -> None:
    # A worker puts its result before it exits, but the queue may deliver it a moment after
    # the exit is visible: read what is still coming before calling the rank dead.
    while rank not in outputs:
        try:
            _take(results.get(timeout=1.0), outputs)
        except queue.Empty:
            raise RuntimeError(f"rank {rank} exited with code {process.exitcode} "
                               "without a result") from None


def _stop(processes: list[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        if process.pid is None:
            continue  # never started
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def _worker(fn: Callable[..., Any], config: ParallelConfig, rank: int, init_method: str,
            backend: str | None, args: tuple, results: Any, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    ok = False
    try:
        init_distributed(config, rank, init_method, backend=backend)
        # Pickled here so that a result that cannot pickle is reported as this rank's error
        # instead of failing silently in the queue's feeder thread.
        message = (rank, True, pickle.dumps(fn(rank, *args)))
        ok = True
    except BaseException:
        message = (rank, False, traceback.format_exc())
    # Flushed before the groups are torn down: tearing them down makes the peers fail too,
    # and the parent must hear this rank's own error first.
    results.put(message)
    results.close()
    results.join_thread()
    if ok:
        # No rank leaves while a peer may still be finishing its last collective.
        get_world_group().barrier()
    destroy_distributed()


def _exit_with_parent(parent_pid: int) -> None:
    # A parent killed without cleaning up (SIGKILL) must not leave workers blocked in a
    # collective forever.
    def watch() -> None:
        while True:
            time.sleep(_PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="muse-parent-watch", daemon=True).start()

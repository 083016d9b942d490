"""Executors: how a step reaches the workers that hold the model.

- `UniExecutor`: one worker, in this process (one device; the default).
- `MultiprocExecutor`: this process is rank 0 and one process per other rank runs a worker on
  the same host; each step's batch is broadcast to them (over the world's CPU group) before
  rank 0 runs its own share, so every rank makes the same collective calls in the same order.

What crosses the process boundary per step is a `StepMessage`: per data-parallel rank the
step's delta (new requests once, then ids, new tokens and block-table growth;
`muse.engine.step_message`), its token count and the logits rows wanted; no sampling state.
Each rank rebuilds its batch from its mirror of the requests. The driver samples.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from muse.engine.metadata import HostBatch
from muse.engine.worker import GreedyVerified, ModelWorker, PendingInputs
from muse.speculative.chained_step import ChainedBatch

logger = logging.getLogger("muse.engine")
# After a failed collective, how long to wait for the process that caused it to be seen dead.
DEATH_GRACE_S = 2.0


class WorkerProcess(Protocol):
    """What the executor needs of a worker rank's process: `multiprocessing.Process`, or a
    handle on a Ray actor (`muse.engine.ray_workers`)."""

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


class WorkerError(RuntimeError):
    """A worker rank died or stopped answering: the engine cannot go on."""


class Executor(ABC):
    # Whether other ranks run the steps too (they then get each step as an encoded delta).
    has_other_ranks = False

    @abstractmethod
    def execute(self, batch: HostBatch, logits_rows: list[int], pending: PendingInputs,
                previous_tokens: torch.Tensor | None, delta: bytes | None = None,
                greedy_verify: bool = False) -> torch.Tensor | GreedyVerified:
        """Logits of `logits_rows`, on the driver's device. `delta`: the step for the other
        ranks (`muse.engine.step_message`), when there are any. `greedy_verify`: see
        `ModelWorker.execute` (logits are a valid answer to it too)."""

    def shutdown(self) -> None:
        """Stop the workers this executor started (none for in-process execution)."""

    def check_health(self) -> None:
        """Raise `WorkerError` if a worker is gone (cheap: called while idle too)."""


class UniExecutor(Executor):
    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    def execute(self, batch: HostBatch, logits_rows: list[int], pending: PendingInputs,
                previous_tokens: torch.Tensor | None, delta: bytes | None = None,
                greedy_verify: bool = False) -> torch.Tensor | GreedyVerified:
        return self.worker.execute(batch, logits_rows, pending, previous_tokens,
                                   greedy_verify)

    def execute_chained(self, batch: ChainedBatch) -> torch.Tensor | GreedyVerified:
        """A verify step made on the device (`ModelWorker.execute_chained`): one rank only,
        whose device holds the step before."""
        return self.worker.execute_chained(batch)


# Sent instead of a step when the engine has been idle a while (see MultiprocExecutor).
KEEPALIVE = "keepalive"


@dataclass(frozen=True)
class StepMessage:
    """What every other rank needs to run a step, per data-parallel rank: its step as an
    encoded `StepDelta` (None when it has nothing to run; a rank rebuilds its batch from its
    own), its token count and its logits rows. The driver's pending inputs are not used: with
    several ranks the driver reads each step back before building the next."""

    deltas: list[bytes | None]
    num_tokens: list[int]
    logits_rows: list[list[int]]


class MultiprocExecutor(Executor):
    """Rank 0 here; `processes` are the other ranks, already running `run_worker` (local
    processes for the `mp` backend, Ray actors for `ray`); `on_shutdown` releases what started
    them, after they have ended.

    The workers wait for each step inside a collective, which fails after the world's timeout
    (`distributed_timeout_s`, how a hung rank is noticed). So that an idle engine does not look
    hung, a thread sends them a keep-alive a few times per timeout when no step has gone out;
    a lock keeps it from interleaving with a step's collectives.
    """

    def __init__(self, worker: ModelWorker, processes: list[WorkerProcess], timeout_s: float,
                 on_shutdown: Callable[[], None] | None = None) -> None:
        from muse.distributed.parallel_state import get_world_group

        self.worker = worker
        self.processes = processes
        self.on_shutdown = on_shutdown
        self.world = get_world_group()
        self.keepalive_s = timeout_s / 4
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._stopped = threading.Event()
        threading.Thread(target=self._keep_workers_waiting, name="muse-keepalive",
                         daemon=True).start()

    def _keep_workers_waiting(self) -> None:
        while not self._stopped.wait(self.keepalive_s / 2):
            with self._lock:
                if self._stopped.is_set() or \
                        time.monotonic() - self._last_sent < self.keepalive_s:
                    continue
                try:
                    self.world.broadcast_object(KEEPALIVE, src=0)
                except RuntimeError:
                    return  # a rank is gone: the next step (or check_health) says which
                self._last_sent = time.monotonic()

    has_other_ranks = True

    def execute(self, batch: HostBatch, logits_rows: list[int], pending: PendingInputs,
                previous_tokens: torch.Tensor | None, delta: bytes | None = None,
                greedy_verify: bool = False) -> torch.Tensor:
        return self.execute_data_parallel([batch], [delta], [logits_rows])[0]

    def execute_data_parallel(self, batches: list[HostBatch | None],
                              deltas: list[bytes | None], logits_rows: list[list[int]]
                              ) -> list[torch.Tensor | None]:
        """One step of every data-parallel rank (`batches[d]` and its encoded `deltas[d]`,
        None where rank d is idle): each rank's logits (None where idle)."""
        self._check_alive()
        num_tokens = [b.num_tokens if b is not None else 0 for b in batches]
        try:
            with self._lock:
                self.world.broadcast_object(StepMessage(deltas, num_tokens, logits_rows), src=0)
                self._last_sent = time.monotonic()
                return self.worker.execute_data_parallel(batches[0], num_tokens, logits_rows)
        except RuntimeError:
            # A collective failed: name the rank that left rather than the transport's error.
            deadline = time.monotonic() + DEATH_GRACE_S
            while time.monotonic() < deadline and all(p.is_alive() for p in self.processes):
                time.sleep(0.05)
            self._check_alive()
            raise WorkerError("a collective with the other ranks failed (a worker hung or "
                              "crashed; see its log)") from None

    def check_health(self) -> None:
        self._check_alive()

    def _check_alive(self) -> None:
        dead = [(rank, p.exitcode) for rank, p in enumerate(self.processes, start=1)
                if not p.is_alive()]
        if dead:
            raise WorkerError("worker " + ", ".join(
                f"rank {rank} exited with code {code}" for rank, code in dead))

    def shutdown(self) -> None:
        self._stopped.set()
        with self._lock:
            if all(p.is_alive() for p in self.processes):
                try:
                    self.world.broadcast_object(None, src=0)
                except RuntimeError:
                    pass  # a rank already gone: end the others below
        stop_workers(self.processes, self.on_shutdown, grace_s=10)


def stop_workers(processes: list[WorkerProcess], on_shutdown: Callable[[], None] | None,
                 grace_s: float = 0.0) -> None:
    """End the workers (after `grace_s` to finish on their own), leave the world, and release
    what started them."""
    from muse.distributed.parallel_state import destroy_distributed

    for process in processes:
        process.join(timeout=grace_s)
        if process.is_alive():
            process.kill()
            process.join()
    destroy_distributed()
    if on_shutdown is not None:
        on_shutdown()


def free_init_method(host: str = "127.0.0.1") -> str:
    """A TCP rendezvous address for a new world, on a free port of this host's `host`
    interface (another machine's workers need an address they can reach)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"

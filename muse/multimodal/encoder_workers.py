"""Encoder disaggregation: the vision / audio encoders in worker processes of their own.

With `encoder_workers` N > 0 (`muse serve --encoder-workers N`) the engine builds no encoder
itself. `EncoderWorkerPool` starts N processes that each build the encoders the engine would
have built (`EncoderRecipe`: a preset's seeded random ones, or a checkpoint's tensors, in the
engine's dtype, on its device) and answers `encode(items)` exactly as `MediaEncoders.encode`
does, so `scatter_media` / `encode_with_cache` take either. The encoder cache stays in the
engine: only its misses reach the workers.

- Start method `spawn`: CUDA cannot be initialised again in a forked child, and a spawned
  worker starts from a clean interpreter whatever threads the engine runs.
- Sharing a step: the items are dealt to the workers largest first, each to the one with the
  fewest encoder tokens so far; each worker encodes its share packed (one vision pass, one
  audio pass) and the outputs are put back in the items' order. Attention inside a pack is
  block-diagonal, so an item's rows do not depend on what it is packed with: the output is
  the in-process one up to float32 rounding (a pack's size can change how a CPU matmul
  splits its sums: seen bit for bit on one machine, within 2e-6 relative on another).
- Hand-off: `torch.multiprocessing` queues, one pair per worker. A CPU tensor put on one
  travels as a shared-memory handle (its storage moved to /dev/shm, the file descriptor
  passed along), so neither pixels nor embeddings are serialised through a pipe; liveness
  comes from the `Process` objects. ZMQ would copy every tensor into a message and back and
  still need its own liveness checks; `multiprocessing.shared_memory` would need our own
  buffer lifetimes. Two details keep descriptors bounded: the engine sends clones of the
  items' tensors (moving a storage to shared memory is in place, and would pin a descriptor
  to every request's media), and copies what comes back into its own memory (the cache
  keeps many outputs, each shared storage would hold a descriptor open).
- CUDA: a worker returns its embeddings on the CPU. A CUDA tensor sent through a queue must
  stay alive in the sender until the receiver is done with it, which a stateless worker
  cannot know; embeddings (tokens x hidden) are small beside the pixels, and the engine
  moves them to its device at once, so the cache holds what it holds in-process.
- Failures: a worker that dies is noticed within `POLL_S` while the engine waits for it (a
  RuntimeError naming it, never a hang), and every later `encode` raises the same error; a
  worker that lives but does not answer within `timeout_s` fails the same way. An exception
  inside a worker's encoders comes back as a RuntimeError naming the worker, with its
  traceback; that worker keeps serving. A worker whose engine is gone (killed) exits by
  itself. `close()` (the engine's `shutdown`) ends the workers.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import signal
import time
import traceback
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as torch_mp

from muse.config import MuseSparkConfig
from muse.multimodal.engine_inputs import (MediaEncoders, build_media_encoders,
                                           load_media_encoders)
from muse.multimodal.processor import ProcessedMedia

logger = logging.getLogger("muse")

POLL_S = 0.1  # how often a waiting engine checks that its workers are alive
STOP_GRACE_S = 5.0  # how long `close()` lets a worker finish before killing it
_READY = -1  # the sequence number of a worker's start-up report


@dataclass(frozen=True)
class EncoderRecipe:
    """What a worker needs to build the engine's encoders (sent to it, so picklable)."""

    config: MuseSparkConfig
    model: str  # a checkpoint folder, or the preset's name
    is_preset: bool
    seed: int
    dtype: torch.dtype
    device: torch.device

    def build(self) -> MediaEncoders | None:
        if self.is_preset:
            return build_media_encoders(self.config, self.seed, self.dtype, self.device)
        return load_media_encoders(self.config, Path(self.model), self.dtype, self.device)


class _Item(NamedTuple):
    """The part of a `ProcessedMedia` the encoders read: all that travels to a worker."""

    kind: str
    data: torch.Tensor


@dataclass
class _Worker:
    index: int
    process: Any  # a spawn-context Process
    requests: Any  # engine -> worker: (sequence number, [_Item]) or None to stop
    responses: Any  # worker -> engine: (sequence number, ok, outputs or a traceback)

    @property
    def name(self) -> str:
        return f"encoder worker {self.index} (pid {self.process.pid})"


def deal(sizes: Sequence[int], num_workers: int) -> list[list[int]]:
    """Each worker's item positions, ascending: the largest items first, each to the worker
    with the fewest tokens so far (the lowest index on ties), so a step's work is spread
    evenly and the dealing depends on the sizes only."""
    shares: list[list[int]] = [[] for _ in range(num_workers)]
    loads = [0] * num_workers
    for position in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        worker = min(range(num_workers), key=lambda w: (loads[w], w))
        shares[worker].append(position)
        loads[worker] += sizes[position]
    return [sorted(share) for share in shares]


class EncoderWorkerPool:
    """`MediaEncoders.encode` over `num_workers` encoder processes (see the module notes)."""

    def __init__(self, recipe: EncoderRecipe, num_workers: int, device: torch.device | str,
                 timeout_s: float | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) \
                or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.media_kinds = media_kinds_of(recipe.config)
        self.items_encoded = 0  # items sent to the workers (the cache's misses)
        self._sequence = itertools.count()
        self._failure: str | None = None
        self.workers = _start(recipe, num_workers)
        # Ends the workers if the pool is dropped without `close()` (and at exit).
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        try:
            for worker in self.workers:
                self._receive(worker, _READY, timeout_s=None)
        except BaseException:
            self.close()
            raise
        logger.info("encoders running in %d worker process(es): pids %s", num_workers,
                    ", ".join(str(w.process.pid) for w in self.workers))

    @property
    def processes(self) -> list[Any]:
        return [worker.process for worker in self.workers]

    def encode(self, items: Sequence[ProcessedMedia]) -> list[torch.Tensor]:
        """Each item's embeddings [tokens, text hidden] on the engine's device, in order."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        if not items:
            return []
        sequence = next(self._sequence)
        sizes = [getattr(item, "num_tokens", item.data.numel()) for item in items]
        sent = []
        for worker, share in zip(self.workers, deal(sizes, len(self.workers))):
            if share:
                worker.requests.put((sequence, [_Item(items[i].kind, items[i].data.clone())
                                                for i in share]))
                sent.append((worker, share))
        out: list[torch.Tensor | None] = [None] * len(items)
        for worker, share in sent:
            outputs = self._receive(worker, sequence, self.timeout_s)
            if len(outputs) != len(share):
                raise RuntimeError(f"{worker.name} returned {len(outputs)} outputs for "
                                   f"{len(share)} items")
            for position, tensor in zip(share, outputs):
                out[position] = tensor.to(self.device, copy=True)  # out of shared memory
        self.items_encoded += len(items)
        return out  # type: ignore[return-value]

    def _receive(self, worker: _Worker, sequence: int, timeout_s: float | None) -> Any:
        """The worker's answer to `sequence`, watching that it stays alive meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                got, ok, payload = worker.responses.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive(worker)
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(f"{worker.name} did not answer within {timeout_s:g} s")
                continue
            except Exception as error:  # unpickling a dying worker's tensors, say
                self._check_alive(worker)
                self._fail(f"{worker.name}: cannot read its answer ({error!r})")
            if got != sequence:
                continue  # the answer to an `encode` that was interrupted
            if not ok:
                if sequence == _READY:
                    self._fail(f"{worker.name} failed to build the encoders:\n{payload}")
                raise RuntimeError(f"{worker.name} failed to encode:\n{payload}")
            return payload

    def _check_alive(self, worker: _Worker) -> None:
        if not worker.process.is_alive():
            self._fail(f"{worker.name} exited with code {worker.process.exitcode}; the "
                       "engine cannot encode media any more (restart it)")

    def _fail(self, message: str) -> None:
        """Raise `message`, and again on every later `encode`: an answer lost with a dead
        or hung worker leaves the pool in no state to trust."""
        self._failure = message
        raise RuntimeError(message)

    def check_health(self) -> None:
        """Raise if a worker has died, also while no media arrives (the engine's idle health
        check calls this)."""
        if self._failure is not None:
            raise RuntimeError(self._failure)
        for worker in self.workers:
            self._check_alive(worker)

    def close(self) -> None:
        """Stop the workers (idempotent); `encode` fails afterwards."""
        if self._failure is None:
            self._failure = "the encoder workers were shut down"
        self._finalizer()


def media_kinds_of(config: MuseSparkConfig) -> tuple[str, ...]:
    """The media kinds the config's encoders read."""
    return (("image", "video") if config.vision_config is not None else ()) \
        + (("audio",) if config.audio_config is not None else ())


def close_encoders(encoders: object) -> None:
    """End the worker processes of an `EncoderWorkerPool`; in-process encoders need nothing."""
    if isinstance(encoders, EncoderWorkerPool):
        encoders.close()


def check_encoders(encoders: object) -> None:
    """Raise if an `EncoderWorkerPool`'s worker has died; in-process encoders cannot."""
    if isinstance(encoders, EncoderWorkerPool):
        encoders.check_health()


def _start(recipe: EncoderRecipe, num_workers: int) -> list[_Worker]:
    context = torch_mp.get_context("spawn")
    workers = []
    for index in range(num_workers):
        requests, responses = context.Queue(), context.Queue()
        process = context.Process(target=_serve, name=f"muse-encoder-{index}", daemon=True,
                                  args=(recipe, requests, responses, os.getpid()))
        process.start()
        workers.append(_Worker(index, process, requests, responses))
    return workers


def _stop(workers: list[_Worker]) -> None:
    """Ask every worker to stop, kill those still running after the grace period."""
    for worker in workers:
        if worker.process.is_alive():
            try:
                worker.requests.put(None)
            except (ValueError, OSError):
                pass  # the queue is already closed
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
    for worker in workers:
        for channel in (worker.requests, worker.responses):
            channel.cancel_join_thread()  # never block exit on a dead reader
            channel.close()


def _serve(recipe: EncoderRecipe, requests: Any, responses: Any, parent_pid: int) -> None:
    """A worker process: build the encoders, report, then encode until told to stop."""
    # Ctrl-C reaches the whole process group; the engine's shutdown ends the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if recipe.device.type == "cuda":
            torch.cuda.set_device(recipe.device)
        encoders = recipe.build()
        if encoders is None:
            raise ValueError("the model's config has no vision or audio encoder")
    except BaseException:
        responses.put((_READY, False, traceback.format_exc()))
        return
    responses.put((_READY, True, None))
    while True:
        try:
            message = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return  # the engine died without stopping us
            continue
        if message is None:
            return
        sequence, items = message
        try:
            outputs = [tensor.cpu() for tensor in encoders.encode(items)]
        except Exception:
            responses.put((sequence, False, traceback.format_exc()))
            continue
        responses.put((sequence, True, outputs))
        del items, outputs  # the shared storages go once the queue has sent them

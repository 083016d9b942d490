"""The front end's handle on the engine core: submit, stream results, abort, watch health.

`ProcessEngineClient` runs the engine core in its own process and talks to it over ZMQ with
msgspec, so HTTP work never stalls the model loop. `ThreadEngineClient` runs the same loop in
a thread of this process (tests, the offline API's server mode).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import queue
import shutil
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec

from muse.engine.args import EngineArgs
from muse.server.messages import (
    AbortRequest,
    AddRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    ExpandedPrompt,
    ExpandPrompt,
    FromEngine,
    LoadLoRA,
    LoRAAdapters,
    MediaArray,
    RequestFailed,
    ResetPrefixCache,
    SampleDelta,
    Shutdown,
    UnloadLoRA,
)

logger = logging.getLogger("muse.server")


class EngineDeadError(RuntimeError):
    """The engine core is gone; in-flight and new requests fail with a server error."""


class RequestError(Exception):
    def __init__(self, message: str, param: str | None, status: int) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class EngineClient:
    """Shared bookkeeping: one queue per in-flight request, fed by the output handler."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue] = {}
        self.stats = EngineStats()
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # Called once with the reason when the engine dies (the server exits).
        self.on_death: Callable[[str], None] | None = None
        self.num_samples = 0  # samples of the requests in flight
        self.num_reserved = 0  # samples admitted whose requests are not in flight yet

    @property
    def healthy(self) -> bool:
        return self.ready is not None and self.dead_reason is None

    def reserve(self, num_samples: int, max_waiting: int) -> bool:
        """Admit `num_samples` more samples unless more than `max_waiting` would then wait
        for the engine; `release` them once their request is in flight (or refused)."""
        waiting = self.num_samples + self.num_reserved - self.stats.running
        if waiting + num_samples > max_waiting:
            return False
        self.num_reserved += num_samples
        return True

    def release(self, num_samples: int) -> None:
        self.num_reserved -= num_samples

    def _dispatch(self, messages: list) -> None:
        for message in messages:
            if isinstance(message, (SampleDelta, RequestFailed, LoRAAdapters, ExpandedPrompt)):
                target = self.queues.get(message.request_id)
                if target is not None:
                    target.put_nowait(message)
            elif isinstance(message, EngineStats):
                self.stats = message
            elif isinstance(message, EngineReady):
                self.ready = message
            elif isinstance(message, EngineDead):
                self._mark_dead(message.message)

    def _mark_dead(self, reason: str) -> None:
        first = self.dead_reason is None
        if first:
            logger.error("engine core died: %s", reason)
            self.dead_reason = reason
        for target in self.queues.values():
            target.put_nowait(EngineDead(reason))
        if first and self.on_death is not None:
            self.on_death(reason)

    def _submit(self, command) -> None:
        raise NotImplementedError

    def reset_prefix_cache(self) -> None:
        """Clear the engine's prefix cache before any request submitted after this call."""
        self._submit(ResetPrefixCache())

    async def _ask(self, command):
        """Send a command the engine answers with one message (between two of its steps);
        that message. A refusal raises `RequestError`."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        target: asyncio.Queue = asyncio.Queue()
        self.queues[command.request_id] = target
        try:
            self._submit(command)
            message = await target.get()
        finally:
            del self.queues[command.request_id]
        if isinstance(message, EngineDead):
            raise EngineDeadError(message.message)
        if isinstance(message, RequestFailed):
            raise RequestError(message.message, message.param, message.status)
        return message

    async def change_lora(self, command: LoadLoRA | UnloadLoRA) -> dict[str, str]:
        """Load or unload an adapter in the engine; the adapters it knows afterwards,
        name -> path."""
        return (await self._ask(command)).adapters

    async def expand_prompt(self, prompt_token_ids: list[int], media: list[MediaArray]
                            ) -> list[int]:
        """The prompt with its media placeholders expanded by the engine's processor."""
        command = ExpandPrompt(self.new_request_id("tokenize"), prompt_token_ids, media)
        return (await self._ask(command)).prompt_token_ids

    async def generate(self, request_id: str, prompt_token_ids: list[int], params,
                       media: list[MediaArray] | None = None, cache_salt: str | None = None,
                       kv_transfer_params: dict | None = None,
                       lora_name: str | None = None) -> AsyncIterator[SampleDelta]:
        """Deltas of every sample of one request until all are finished. `media`: the
        decoded media of the prompt's placeholders, in order; `cache_salt`: see
        `Engine.add_request`; `lora_name`: a loaded adapter to run with.

        Leaving early (a client that went away) aborts the request in the engine.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        target: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = target
        unfinished = set(range(params.n))
        self.num_samples += params.n
        try:
            self._submit(AddRequest(request_id, prompt_token_ids, params, media or [],
                                    cache_salt, kv_transfer_params, lora_name))
            while unfinished:
                message = await target.get()
                if isinstance(message, EngineDead):
                    raise EngineDeadError(message.message)
                if isinstance(message, RequestFailed):
                    raise RequestError(message.message, message.param, message.status)
                if message.finish_reason is not None:
                    unfinished.discard(message.index)
                yield message
        finally:
            del self.queues[request_id]
            self.num_samples -= params.n
            if unfinished and self.dead_reason is None:
                self._submit(AbortRequest(request_id))

    def abort(self, request_id: str) -> None:
        if self.dead_reason is None:
            self._submit(AbortRequest(request_id))

    @staticmethod
    def new_request_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


class ThreadEngineClient(EngineClient):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__()
        self.args = args
        self.commands: queue.Queue = queue.Queue()
        self.thread: threading.Thread | None = None

    def _submit(self, command) -> None:
        self.commands.put(command)

    async def start(self) -> None:
        from muse.engine.engine import EngineCore
        from muse.server.engine_loop import EngineLoop

        self.loop = asyncio.get_running_loop()
        engine = await asyncio.to_thread(EngineCore, self.args)

        def receive(timeout: float) -> list:
            try:
                commands = [self.commands.get(timeout=timeout) if timeout else
                            self.commands.get_nowait()]
            except queue.Empty:
                return []
            while True:
                try:
                    commands.append(self.commands.get_nowait())
                except queue.Empty:
                    return commands

        def send(messages: list) -> None:
            self.loop.call_soon_threadsafe(self._dispatch, messages)

        engine_loop = EngineLoop(engine, receive, send)
        self.ready = engine_loop.ready_message()

        def run() -> None:
            try:
                engine_loop.run()
            except Exception as error:
                logger.exception("engine loop failed")
                self.loop.call_soon_threadsafe(self._mark_dead, f"{type(error).__name__}: {error}")

        self.thread = threading.Thread(target=run, name="muse-engine", daemon=True)
        self.thread.start()

    async def shutdown(self) -> None:
        self._submit(Shutdown())
        if self.thread is not None:
            await asyncio.to_thread(self.thread.join, 10)


class ProcessEngineClient(EngineClient):
    """The engine core in a process of its own.

    If that process dies, in-flight requests fail at once; then either the server is told
    (`on_death`: it exits, so a supervisor can restart it) or, with `restart`, a new engine
    process is started and requests are served again once it is ready.
    """

    def __init__(self, args: EngineArgs, start_timeout_s: float = 600.0,
                 restart: bool = False) -> None:
        super().__init__()
        self.args = args
        self.start_timeout_s = start_timeout_s
        self.restart = restart
        self.process: multiprocessing.Process | None = None
        self.tasks: list[asyncio.Task] = []
        self.socket_dir: str | None = None
        self.restarts = 0

    def _mark_dead(self, reason: str) -> None:
        if not self.restart:
            super()._mark_dead(reason)
            return
        on_death, self.on_death = self.on_death, None  # a restart is not the server's end
        try:
            super()._mark_dead(reason)
        finally:
            self.on_death = on_death

    async def start(self) -> None:
        import zmq
        import zmq.asyncio

        from muse.server.engine_loop import run_engine_process

        self.loop = asyncio.get_running_loop()
        self.socket_dir = tempfile.mkdtemp(prefix="muse-")
        atexit.register(shutil.rmtree, self.socket_dir, ignore_errors=True)
        to_engine = f"ipc://{Path(self.socket_dir) / 'in'}"
        from_engine = f"ipc://{Path(self.socket_dir) / 'out'}"
        self.context = zmq.asyncio.Context()
        self.outbox = self.context.socket(zmq.PUSH)
        self.outbox.bind(to_engine)
        self.inbox = self.context.socket(zmq.PULL)
        self.inbox.bind(from_engine)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(FromEngine)
        spawn = multiprocessing.get_context("spawn")
        # Not a daemon, so that it may start worker processes of its own (tensor parallelism);
        # it is ended at exit below, and exits by itself when this process is gone.
        self.process = spawn.Process(target=run_engine_process, name="muse-engine-core",
                                     args=(self.args, to_engine, from_engine))
        self.process.start()
        atexit.register(_kill_if_alive, self.process)
        self.tasks = [asyncio.create_task(self._read_outputs()),
                      asyncio.create_task(self._watch_process())]
        waited = 0.0
        while self.ready is None:
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if waited > self.start_timeout_s:
                raise EngineDeadError("the engine core did not start in time")
            await asyncio.sleep(0.1)
            waited += 0.1

    def _submit(self, command) -> None:
        self.outbox.send(self.encoder.encode(command), copy=False)

    async def _read_outputs(self) -> None:
        while True:
            self._dispatch(self.decoder.decode(await self.inbox.recv()))

    async def _watch_process(self) -> None:
        while self.process.is_alive():
            await asyncio.sleep(0.5)
        # Let a last message (its reason) arrive before declaring the cause unknown.
        await asyncio.sleep(0.2)
        self._mark_dead(f"the engine core process exited with code {self.process.exitcode}")
        if self.restart:
            self._restart_task = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        self.restarts += 1
        logger.warning("restarting the engine core (restart %d)", self.restarts)
        await self.shutdown()
        self.ready, self.dead_reason, self.stats = None, None, EngineStats()
        try:
            await self.start()
        except EngineDeadError as error:
            self.restart, self.dead_reason = False, None
            self._mark_dead(f"the engine core could not be restarted: {error}")
        else:
            logger.info("the engine core is back")

    async def shutdown(self) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        if self.process is not None and self.process.is_alive():
            self._submit(Shutdown())
            await asyncio.to_thread(self.process.join, 10)
            if self.process.is_alive():
                self.process.kill()
        self.outbox.close(linger=0)
        self.inbox.close(linger=0)
        self.context.term()
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)


def _kill_if_alive(process: multiprocessing.Process) -> None:
    # Registered after multiprocessing's own exit handler, so it runs first: that handler
    # joins non-daemon children and would otherwise wait for the engine forever.
    if process.is_alive():
        process.kill()
        process.join()

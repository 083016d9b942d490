"""Grammar compiles on worker threads, so the engine loop keeps stepping while they run.

xgrammar releases the GIL while it compiles (a Python loop beside a 30k-value enum compile
keeps its full speed), so threads are enough. A process could be killed on timeout, but it
would have to serialise the compiled grammar back, which costs about three times the compile
(a 16k-value enum: 2.5 s to compile, 5.7 s to serialise, 6.7 s to read back).

Each job has a deadline `timeout_s` after it is submitted; requests asking for a grammar that
is being compiled share its job and its deadline. A job still compiling at its deadline fails
its requests with a 400 (the schema takes too long to compile); one that never got a thread
fails them with a 503 (every compile thread is busy). xgrammar cannot interrupt a compile, so
a timed-out compile runs on, holding its thread, and its result is dropped: at most
`num_threads` compiles use the CPU at once whatever clients send.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from muse.engine.grammar_cache import GrammarCache
from muse.engine.structured_output import StructuredOutput, StructuredOutputError

logger = logging.getLogger("muse")


def threads_per_compile(num_compile_threads: int) -> int:
    """xgrammar threads for one compile: the cores left once the engine loop has one, shared
    by the concurrent compiles (at most xgrammar's default of 8). More threads than cores
    take the loop's core: on 2 cores, a plain request decoding beside a 30k-value enum
    compile took 75% longer with 8 xgrammar threads, 2% longer with 1, and the compile was
    no faster with 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(8, max(1, ((cores or 1) - 1) // num_compile_threads))


@dataclass(eq=False)
class CompileJob:
    spec: StructuredOutput  # a grammar key: no per-request fields
    deadline: float  # time.monotonic()
    started: bool = False
    cancelled: bool = False  # nobody waits for it: a thread that picks it up skips it
    done: bool = False
    compiled: Any = None
    error: StructuredOutputError | None = None


class GrammarJobs:
    def __init__(self, compiler, cache: GrammarCache, num_threads: int, timeout_s: float
                 ) -> None:
        self.compiler = compiler  # anything with compile(spec); looked up on every job
        self.cache = cache
        self.num_threads = num_threads
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[CompileJob] = queue.SimpleQueue()
        self._pending: dict[StructuredOutput, CompileJob] = {}  # submitted, not collected
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def has_pending(self) -> bool:
        """Jobs submitted and not collected yet (some may have lost all their requests)."""
        return bool(self._pending)

    def submit(self, spec: StructuredOutput) -> CompileJob:
        """The job compiling `spec`'s grammar: a new one, or the one already under way."""
        key = spec.grammar_key
        with self._lock:
            job = self._pending.get(key)
            if job is not None:
                return job
            job = self._pending[key] = CompileJob(key, time.monotonic() + self.timeout_s)
        while len(self._threads) < self.num_threads:
            # Daemons: a compile cannot be interrupted and must not keep the process alive.
            thread = threading.Thread(target=self._work, daemon=True,
                                      name=f"muse-grammar-{len(self._threads)}")
            thread.start()
            self._threads.append(thread)
        self._queue.put(job)
        return job

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more. One already compiling still finishes, and its
        grammar is cached when collected."""
        with self._lock:
            if not job.started and not job.done:
                job.cancelled = True
                self._pending.pop(job.spec, None)

    def collect(self) -> list[CompileJob]:
        """Jobs that finished, failed or passed their deadline since the last call; the
        grammars compiled go into the cache."""
        self._finished.clear()  # before looking, so a compile ending after wakes `wait`
        now = time.monotonic()
        collected = []
        with self._lock:
            for key, job in list(self._pending.items()):
                if not job.done and now > job.deadline:
                    job.error = self._late(job)
                    job.cancelled = job.done = True
                if job.done:
                    del self._pending[key]
                    collected.append(job)
        for job in collected:
            if job.error is None:
                self.cache.put(job.spec, job.compiled)
        return collected

    def wait(self, timeout_s: float) -> None:
        """Block until a compile ends (or one ended since `collect`) or `timeout_s` passes."""
        self._finished.wait(timeout_s)

    def _late(self, job: CompileJob) -> StructuredOutputError:
        field_name = job.spec.field_name
        if not job.started:
            return StructuredOutputError(
                f"every grammar compile thread stayed busy for {self.timeout_s:g} s, so "
                f"`{field_name}` could not be compiled; retry later", param=field_name,
                status=503)
        what = "the tool schemas in `tools`" if field_name == "tools" \
            else "the schema in `response_format`"
        return StructuredOutputError(
            f"{what} took too long to compile (the limit is {self.timeout_s:g} s); "
            "simplify it", param=field_name)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            with self._lock:
                if job.cancelled:
                    continue
                job.started = True
            compiled, error = None, None
            try:
                compiled = self.compiler.compile(job.spec)
            except StructuredOutputError as request_error:
                error = request_error
            except Exception:  # a failure of ours must fail the request, not leave it waiting
                logger.exception("compiling a grammar failed")
                error = StructuredOutputError(
                    f"internal error while compiling `{job.spec.field_name}`",
                    param=job.spec.field_name, status=500)
            with self._lock:
                if not job.done:  # else its deadline passed and its requests have failed
                    job.compiled, job.error, job.done = compiled, error, True
            self._finished.set()

"""Replaying a trace at one load level: simulated users running sessions turn by turn.

At a fixed concurrency C, C users each run one session at a time (think time included) and
take the next session when theirs ends. At a request rate, sessions arrive as a seeded Poisson
process (single-request workloads: requests per second), optionally capped at a concurrency.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from muse.bench.client import RequestOptions, body_digest, request_body, stream_request
from muse.bench.progress import LevelProgress
from muse.bench.trace import Session


@dataclass
class Level:
    index: int
    concurrency: int | None  # simultaneous sessions; None: no cap
    request_rate: float | None  # session arrivals per second; None: all at once
    num_sessions: int

    @property
    def label(self) -> str:
        if self.request_rate is None:
            return f"concurrency {self.concurrency}"
        cap = f", max concurrency {self.concurrency}" if self.concurrency else ""
        return f"rate {self.request_rate:g}/s{cap}"


@dataclass
class ReplayOptions:
    request: RequestOptions
    # "server": append the server's reply (so prefixes match what the server cached);
    # "trace": append the trace's scripted reply (identical requests on every server).
    assistant_history: str = "server"
    # Prepended to each session's first message with the level index, so no level reuses
    # another's (or an earlier run's) prefix cache. None: no salt.
    salt: str | None = None
    seed: int = 0  # of the Poisson arrivals
    progress: bool = True
    progress_interval_s: float = 30.0  # between progress lines where stderr is not a terminal


@dataclass
class RequestRecord:
    level: int
    session_id: str
    turn: int
    start_s: float  # since the level started
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    num_chunks: int
    intended_input_tokens: int | None
    intended_output_tokens: int
    body_sha256: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class LevelRun:
    level: Level
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0


def salted(messages: list[dict[str, Any]], salt: str) -> list[dict[str, Any]]:
    messages = copy.deepcopy(messages)
    first = messages[0]
    content = first.get("content")
    if isinstance(content, list):
        first["content"] = [{"type": "text", "text": salt}] + content
    else:
        first["content"] = salt + (content or "")
    return messages


def arrival_times(num_sessions: int, rate: float | None, seed: int) -> list[float]:
    if rate is None or math.isinf(rate):
        return [0.0] * num_sessions
    rng = random.Random(f"{seed}:arrivals")
    times, now = [], 0.0
    for _ in range(num_sessions):
        times.append(now)
        now += rng.expovariate(rate)
    return times


async def run_level(http: httpx.AsyncClient, sessions: list[Session], level: Level,
                    options: ReplayOptions) -> LevelRun:
    run = LevelRun(level)
    gate = asyncio.Semaphore(level.concurrency) if level.concurrency else None
    arrivals = arrival_times(len(sessions), level.request_rate, options.seed + level.index)
    # Short, so that what follows (each request's own header) starts within the first
    # KV block and unrelated requests share no whole block.
    salt = f"[{options.salt}/{level.index}] " if options.salt is not None else None
    progress = LevelProgress(level.label, sum(s.num_requests for s in sessions),
                             options.progress, options.progress_interval_s)
    start = time.perf_counter()

    async def replay(session: Session, arrival: float) -> None:
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - start)))
        async with gate or contextlib.nullcontext():
            history: list[dict[str, Any]] = []
            for number, turn in enumerate(session.turns):
                if turn.delay_s:
                    await asyncio.sleep(turn.delay_s)
                new = turn.messages
                if number == 0 and salt is not None:
                    new = salted(new, salt)
                history = history + new
                body = request_body(history, turn.output_tokens, options.request)
                sent = time.perf_counter() - start
                result = await stream_request(http, options.request.endpoint, body)
                run.records.append(RequestRecord(
                    level.index, session.id, number, sent, result.ttft_s, result.e2e_s,
                    result.itl_s, result.prompt_tokens, result.completion_tokens,
                    result.cached_tokens, result.num_chunks, turn.intended_input_tokens,
                    turn.output_tokens, body_digest(body), result.error))
                progress.update(output_tokens=result.completion_tokens or 0)
                if result.error is not None:
                    # Later turns would build on a reply that never came: the session ends.
                    progress.update(len(session.turns) - number - 1)
                    return
                reply = turn.assistant if options.assistant_history == "trace" \
                    and turn.assistant is not None else result.text
                history = history + [{"role": "assistant", "content": reply}]

    reporter = asyncio.create_task(progress.report())
    try:
        await asyncio.gather(*(replay(s, t) for s, t in zip(sessions, arrivals)))
    finally:
        run.duration_s = time.perf_counter() - start
        reporter.cancel()
        progress.close()
    run.records.sort(key=lambda r: (r.start_s, r.session_id, r.turn))
    return run

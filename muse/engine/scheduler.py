"""Decides what runs each step: continuous batching under a token budget.

There are no prefill and decode phases: every running request asks for the tokens it has not
computed yet (a whole prompt chunk, or one token when decoding) and the step's budget of
`max_num_batched_tokens` is handed out oldest request first, so chunked prefills mix with
decodes in one step. When a pool runs out of blocks the newest running request is preempted
(its KV is freed and recomputed later, helped by the prefix cache); the oldest always makes
progress, so nothing starves. Waiting requests are admitted first come first served.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from muse.engine.kv_cache import KVCacheManager
from muse.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, starting at request.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: newest is preempted first
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request, front: bool = False) -> None:
        request.status = RequestStatus.WAITING
        (self.waiting.appendleft if front else self.waiting.append)(request)

    def finish(self, request: Request, status: RequestStatus, reason: str | None) -> None:
        """Retire a request (finished or aborted) and give its blocks back at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status, request.finish_reason = status, reason
        request.num_pending_tokens = 0  # a step in flight computed past the end: discarded
        self.kv_cache.free(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_token_probs = [], None
        request.spec_token_device = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request, front=True)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.final_token_pending:
                index += 1  # it ends when the step in flight is read back
                continue
            known = request.num_tokens - request.num_computed_tokens
            num_new = min(known + len(request.spec_token_ids), budget)
            # Drafts that do not fit in the budget are dropped (a shorter draft).
            kept = max(num_new - known, 0)
            del request.spec_token_ids[kept:]
            if request.spec_token_probs is not None:
                request.spec_token_probs = request.spec_token_probs[:kept]
            while not self.kv_cache.allocate(request, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
        # Admitting while preempting would only evict the newcomers again.
        while (self.waiting and budget > 0 and not output.preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            cached = 0
            if request.num_computed_tokens == 0:
                cached = self.kv_cache.find_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens - cached, budget)
            if not self.kv_cache.allocate(request, num_new, cached):
                break  # first come first served: nobody overtakes the head of the queue
            if request.num_preemptions == 0 and request.parent is None:
                self.kv_cache.record_cache_query(request.num_prompt_tokens, cached)
                request.num_cached_tokens = cached
            request.num_computed_tokens += cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            output.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return output

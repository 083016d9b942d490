"""Decides what runs each step: continuous batching under a token budget.

There are no prefill and decode phases: every running request asks for the tokens it has not
computed yet (a whole prompt chunk, or one token when decoding) and the step's budget of
`max_num_batched_tokens` is handed out oldest request first, so chunked prefills mix with
decodes in one step. When a pool runs out of blocks the newest running request is preempted
(its KV is freed and recomputed later, helped by the prefix cache); the oldest always makes
progress, so nothing starves. Waiting requests are admitted first come first served.

Media: a step also has an encoder budget, `max_num_encoder_input_tokens` encoder output
tokens of the items it newly encodes (an item in the encoder cache, or already counted this
step, costs nothing). A request whose chunk would start an item that does not fit stops
before the item's first span and waits for a later step; an item larger than the whole budget
runs in a step that encodes nothing else, so it never starves. Items a running request has
begun but not finished stay pinned in the encoder cache (`RequestPins`) until it passes them,
finishes, is aborted or is preempted.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from muse.engine.kv_cache import KVCacheManager
from muse.engine.request import Request, RequestStatus
from muse.multimodal.encoder_cache import EncoderCache, RequestPins


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


@dataclass
class EncoderBudget:
    """One step's encoder budget: output tokens of the items it newly encodes, and their
    hashes (an item met again in the step is encoded once)."""

    limit: int
    spent: int = 0
    hashes: set[str] = field(default_factory=set)

    def charge(self, items: list) -> None:
        self.spent += sum(item.num_tokens for item in items)
        self.hashes.update(item.content_hash for item in items)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int, max_num_encoder_input_tokens: int | None = None,
                 encoder_cache: EncoderCache | None = None) -> None:
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens \
            or max_num_batched_tokens
        # The driver's encoder cache: what is in it costs no encoder budget. Every step's
        # encoding runs while it is launched, before the next one is scheduled, so this view
        # is current when a step is scheduled.
        self.encoder_cache = encoder_cache
        self.pins = RequestPins(encoder_cache) if encoder_cache is not None else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: newest is preempted first
        self.num_preemptions = 0
        # Called with each retired request before its blocks go back (a KV connector's).
        self.on_finish: Callable[[Request], None] | None = None

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
        if self.on_finish is not None:  # a KV connector's look at the blocks, still in place
            self.on_finish(request)
        self.kv_cache.free(request)
        if self.pins is not None:
            self.pins.release(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        if self.pins is not None:
            self.pins.release(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids, request.spec_token_probs = [], None
        request.spec_token_device = None
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request, front=True)

    def _update_pins(self) -> None:
        if self.pins is not None:
            for request in self.running:
                if request.media:
                    self.pins.update(request.request_id, request.media,
                                     request.num_computed_tokens)

    def _fit_encoder_budget(self, request: Request, start: int, num_new: int,
                            encoder: EncoderBudget) -> tuple[int, list]:
        """`num_new` cut so that the items the chunk [start, start + num_new) newly encodes
        fit what is left of the step's encoder budget, and those items (charged once the
        chunk is scheduled). The cut stops before the first item that does not fit."""
        end = start + num_new
        spent, hashes, items = encoder.spent, set(encoder.hashes), []
        for item in request.media:  # in prompt order
            if not any(s < end and start < s + n for s, n in item.spans):
                continue
            key = item.content_hash
            if key in hashes or (self.encoder_cache is not None and key in self.encoder_cache):
                continue
            # An item larger than the whole budget fits a step that encodes nothing else.
            if spent and spent + item.num_tokens > encoder.limit:
                return max(item.spans[0][0] - start, 0), items
            spent += item.num_tokens
            hashes.add(key)
            items.append(item)
        return num_new, items

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        encoder = EncoderBudget(self.max_num_encoder_input_tokens)
        self._update_pins()
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.final_token_pending:
                index += 1  # it ends when the step in flight is read back
                continue
            known = request.num_tokens - request.num_computed_tokens
            num_new = min(known + len(request.spec_token_ids), budget)
            encoded: list = []
            if request.media:
                num_new, encoded = self._fit_encoder_budget(
                    request, request.num_computed_tokens, num_new, encoder)
                if num_new == 0:
                    index += 1  # its next item waits for a step with encoder budget left
                    continue
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
                encoder.charge(encoded)
                index += 1
        # Admitting while preempting would only evict the newcomers again.
        while (self.waiting and budget > 0 and not output.preempted
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            cached = 0
            if request.num_computed_tokens == 0:
                cached = self.kv_cache.find_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens - cached, budget)
            encoded = []
            if request.media:
                num_new, encoded = self._fit_encoder_budget(
                    request, request.num_computed_tokens + cached, num_new, encoder)
                if num_new == 0:
                    break  # first come first served, also for the encoder budget
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
            encoder.charge(encoded)
        return output

"""The per-step message from the driver (rank 0) to the other ranks, and the batch it rebuilds.

The driver schedules and samples; the other ranks need each step's `HostBatch`, whose block
tables grow with the context. Instead each rank mirrors the requests: one is sent whole once
(`NewRequestData`: tokens so far, block tables), then only as what was appended since
(`CachedRequestData`: tokens, sampled ones included, and table entries), and dropped when it
finishes or is preempted. A decode step costs a few ints a request whatever the context.

Block tables only grow by appends, except that entries before a sliding layer's window start
become the null block; a step never reads those (tables are sliced from the window start), so
the mirror may keep the old values. A preempted request's blocks are freed and reallocated
when it resumes: it is sent again as new.

A request with media carries its items in its `NewRequestData` (the encoder input's bytes,
dtype and shape, its spans and content hash), only those with tokens still to compute. Each
rank rebuilds the `ProcessedMedia` once and, every step, the step's `MediaSlice`s from its
mirror (`RequestMirror.step_media`), as the driver's runner does, so every rank scatters the
same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from muse.engine.kv_transfers import KVTransfers
from muse.engine.metadata import BatchEntry
from muse.engine.request import Request
from muse.engine.scheduler import ScheduledRequest
from muse.multimodal.engine_inputs import MediaSlice, media_slices
from muse.multimodal.processor import ProcessedMedia
from muse.multimodal.vision import PatchGrid

BlockTables = Callable[[Request], dict[str, list[int]]]


# ---- the message -----------------------------------------------------------------------------
class MediaItemData(msgspec.Struct, array_like=True):
    """One `ProcessedMedia` as it travels: the encoder input as raw bytes with its dtype and
    shape (any dtype, bfloat16 included), and what places its rows in the prompt."""

    kind: str
    index: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: list[int]
    data: bytes
    spans: list[tuple[int, int]]
    content_hash: str  # the driver's: the cache key, not recomputed on the ranks
    grid: tuple[int, int, int] | None = None  # temporal, height, width (images and videos)
    timestamps: list[float] | None = None  # a video's frame groups, seconds


# Positional (array_like) with small int tags: a decode request is ~[1, id, start, 1, [t], []].
class NewRequestData(msgspec.Struct, tag=0, array_like=True, omit_defaults=True):
    """A request the workers do not hold (or hold from before a preemption): sent whole."""

    request_id: str
    start: int
    num_new_tokens: int
    token_ids: list[int]  # tokens 0.. as far as known and needed by this step
    block_tables: list[list[int]]  # per kind, in the kinds' order
    # Its media items with tokens at or after `start` (omitted, not sent, when none).
    media: list[MediaItemData] = msgspec.field(default_factory=list)


class CachedRequestData(msgspec.Struct, tag=1, array_like=True):
    """A request the workers hold: only what was appended since it was last sent."""

    request_id: str
    start: int
    num_new_tokens: int
    new_token_ids: list[int]
    new_block_ids: list[list[int]]  # per kind in the kinds' order; [] when no table grew


class StepDelta(msgspec.Struct, array_like=True):
    scheduled: list[NewRequestData | CachedRequestData]  # in the batch's request order
    finished: list[str]  # ids to drop (finished, aborted, preempted), applied first
    transfers: KVTransfers | None = None  # copies between KV tiers before the step

    @property
    def new(self) -> list[NewRequestData]:
        return [i for i in self.scheduled if isinstance(i, NewRequestData)]

    @property
    def cached(self) -> list[CachedRequestData]:
        return [i for i in self.scheduled if isinstance(i, CachedRequestData)]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepDelta)


def encode_delta(delta: StepDelta) -> bytes:
    return _encoder.encode(delta)


def decode_delta(data: bytes) -> StepDelta:
    return _decoder.decode(data)


def encode_media(media: Sequence[ProcessedMedia], start: int) -> list[MediaItemData]:
    """The items of a request the ranks still need from position `start` on: those with a
    span ending after it (a finished prefill sends none; a preempted request is resent as
    new, from its new start)."""
    return [_media_item(item) for item in media
            if any(s + n > start for s, n in item.spans)]


def _media_item(item: ProcessedMedia) -> MediaItemData:
    data = item.data.detach().cpu().contiguous()
    grid = item.grid
    return MediaItemData(
        item.kind, item.index, str(data.dtype).removeprefix("torch."), list(data.shape),
        # Viewed as bytes first: numpy has no bfloat16.
        data.reshape(-1).view(torch.uint8).numpy().tobytes(),
        [tuple(span) for span in item.spans], item.content_hash,
        (grid.temporal, grid.height, grid.width) if grid is not None else None,
        list(item.timestamps) if item.timestamps is not None else None)


def decode_media(item: MediaItemData) -> ProcessedMedia:
    """The `ProcessedMedia` the driver sent, its encoder input on the CPU (the encoders move
    it to their device)."""
    dtype = getattr(torch, item.dtype)
    # bytearray: a writable buffer, so the tensor does not alias read-only message memory.
    raw = torch.frombuffer(bytearray(item.data), dtype=torch.uint8) if item.data \
        else torch.empty(0, dtype=torch.uint8)
    data = raw.view(dtype).reshape(item.shape)
    return ProcessedMedia(item.kind, item.index, data, [tuple(s) for s in item.spans],
                          item.content_hash,
                          PatchGrid(*item.grid) if item.grid is not None else None,
                          list(item.timestamps) if item.timestamps is not None else None)


# ---- the two ends ----------------------------------------------------------------------------
@dataclass(slots=True)
class _Sent:
    """What the workers hold of one request."""

    request: Request  # the object sent: a reused id after a finish is another request
    num_tokens: int
    num_blocks: list[int]  # per kind
    num_preemptions: int


class StepEncoder:
    """The driver's side: knows what the workers hold, sends each step only the difference."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = list(kinds)
        self.sent: dict[str, _Sent] = {}

    def encode_bytes(self, scheduled: list[ScheduledRequest], block_tables: BlockTables,
                     transfers: KVTransfers | None = None) -> bytes:
        """`encode`, as the bytes that travel."""
        return encode_delta(self.encode(scheduled, block_tables, transfers))

    def encode(self, scheduled: list[ScheduledRequest], block_tables: BlockTables,
               transfers: KVTransfers | None = None) -> StepDelta:
        """The step's delta; call it where the batch is built (before `num_computed_tokens`
        advances), once per step: it records what the workers will then hold."""
        items: list[NewRequestData | CachedRequestData] = []
        for item in scheduled:
            request, n = item.request, item.num_new_tokens
            start, request_id = request.num_computed_tokens, request.request_id
            by_kind = block_tables(request)
            tables = [by_kind[kind] for kind in self.kinds]
            # Tokens sampled by a step not read back yet have no value here (overlapped
            # schedule): they are sent once known; the mirror reads them as 0 meanwhile, as
            # `Request.token_ids` does for the driver.
            known = min(start + n, request.num_tokens - request.num_pending_tokens)
            sent = self.sent.get(request_id)
            if (sent is None or sent.request is not request
                    or sent.num_preemptions != request.num_preemptions):
                items.append(NewRequestData(request_id, start, n, request.token_ids(0, known),
                                            [list(table) for table in tables],
                                            encode_media(request.media, start)))
                self.sent[request_id] = _Sent(request, known, [len(t) for t in tables],
                                              request.num_preemptions)
                continue
            new_tokens = request.token_ids(sent.num_tokens, max(known, sent.num_tokens))
            new_blocks = [table[count:] for table, count in zip(tables, sent.num_blocks)]
            items.append(CachedRequestData(request_id, start, n, new_tokens,
                                           new_blocks if any(new_blocks) else []))
            sent.num_tokens = max(sent.num_tokens, known)
            sent.num_blocks = [len(table) for table in tables]
        # Held requests not scheduled: dropped once finished or preempted. A held request
        # leaves `running` only so, and is dropped the next step: this visits ~`running`.
        scheduled_ids = {item.request.request_id for item in scheduled}
        finished = [request_id for request_id, sent in self.sent.items()
                    if request_id not in scheduled_ids and (
                        sent.request.is_finished
                        or sent.request.num_preemptions != sent.num_preemptions)]
        for request_id in finished:
            del self.sent[request_id]
        return StepDelta(items, finished, transfers)


class RequestMirror:
    """A worker's side: the requests' tokens and block tables, kept up to date by deltas."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = list(kinds)
        # request id -> (token ids so far, block table per kind)
        self.requests: dict[str, tuple[list[int], dict[str, list[int]]]] = {}
        # request id -> its media items (requests with media only); the same objects every
        # step, so a step's slices of one item share its encoder output
        self.media: dict[str, list[ProcessedMedia]] = {}

    def apply(self, delta: StepDelta) -> list[BatchEntry]:
        """Update the mirror; returns the step's entries for `build_host_batch`, in order."""
        for request_id in delta.finished:
            self.requests.pop(request_id, None)
            self.media.pop(request_id, None)
        entries = []
        for item in delta.scheduled:
            if isinstance(item, NewRequestData):
                tokens, tables = item.token_ids, dict(zip(self.kinds, item.block_tables))
                self.requests[item.request_id] = (tokens, tables)
                self._hold_media(item)
            else:
                tokens, tables = self.requests[item.request_id]
                tokens.extend(item.new_token_ids)
                for kind, blocks in zip(self.kinds, item.new_block_ids):
                    tables[kind].extend(blocks)
            start, end = item.start, item.start + item.num_new_tokens
            # Tokens not sent yet (pending on the driver) read as 0, as on the driver.
            inputs = tokens[start:end] + [0] * (end - max(start, len(tokens)))
            entries.append(BatchEntry(inputs, start, item.num_new_tokens, tables))
        return entries

    def _hold_media(self, item: NewRequestData) -> None:
        if item.media:
            self.media[item.request_id] = [decode_media(m) for m in item.media]
        else:
            self.media.pop(item.request_id, None)  # a reused id, or resent past its media

    def step_media(self, delta: StepDelta) -> list[MediaSlice]:
        """The step's media slices, as the driver's runner builds them: each request's
        tokens [start, start + num_new_tokens) at its offset among the step's tokens. Call
        after `apply` for the same delta.

        Items the step takes the last rows of are then let go: positions only move forward
        (a preempted request comes back as new, with its items), and a video's input may be
        large to keep through a long decode."""
        slices: list[MediaSlice] = []
        offset = 0
        for item in delta.scheduled:
            media = self.media.get(item.request_id)
            end = item.start + item.num_new_tokens
            if media:
                slices += media_slices(media, item.start, end, offset)
                ahead = [m for m in media if any(s + n > end for s, n in m.spans)]
                if ahead:
                    self.media[item.request_id] = ahead
                else:
                    del self.media[item.request_id]
            offset += item.num_new_tokens
        return slices

"""CUDA graphs for decode, verify and one-request prefill steps.

A decode step runs a few dozen small kernels per layer; at small batches the GPU finishes each
in microseconds and the host's launches set the pace. So the decode forward of each batch-size
bucket is captured once at start-up, over static input buffers, and a step copies its
metadata into the first rows of the smallest bucket that holds it and replays the graph.

Padding rows decode token 0 at position 0 against the null block (block 0 of every pool),
whose slot they also write: real requests never read the null block unmasked, so padding
changes nothing they see. Steps the graphs do not cover (prefill chunks, batches larger than
the largest bucket, block tables wider than captured) run eagerly.

Speculative decoding verifies up to 1 + k tokens per request. Its graphs (`query_len` 1 + k)
give every request 1 + k query rows: a request with fewer tokens is padded after its last
one by tokens that write the null block's slot and whose positions continue its own. Its
context length counts them, so its real queries keep their positions and see only real keys
(causal), and only padding queries read the slots they would have filled.

A prefill step of one request (a chat's prompt at batch 1, the last chunk of a long one)
runs a few hundred eager launches, which at batch 1 take longer than its GPU work. Graphs of
query lengths 16 to `prefill_graph_max_tokens` (`prefill_query_lens`) with one request each
take such steps the same way, padded like a verify step to the next captured length.

Speculative verify graphs (`greedy_verification`) come in two versions per bucket where
the logits fit in `GREEDY_VERIFY_MAX_LOGITS_BYTES`, sharing their inputs and memory: the
plain one, and one that also holds the step's greedy verification (the final norm, the LM
head, the argmax of every query row and each request's accepted count, `verify_greedy_rows`),
so that an all-greedy verify step without logprobs reads back one small tensor and runs
nothing eagerly after the replay. With a drafter whose greedy drafts stay on the device
(`draft_next`), that version then drafts the next step's blocks too, anchored at each
request's last emitted token (what the drafter's own graph would do right after: one launch
a step instead of two). Steps that sample replay the plain version, which computes nothing
they would not use.

With LoRA adapters (`enable_lora`) every graph also reads each request's adapter slot from a
static row (-1: the base model, and for padding), so steps mixing adapters and the base
replay graphs too; the adapted layers' batched kernels are part of every captured step.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch

from muse.engine.metadata import HostBatch
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata
from muse.engine.transfer import to_device
from muse.speculative.chained_step import ChainedBatch
from muse.speculative.verification import verify_greedy_rows

logger = logging.getLogger("muse")
# The largest float32 logits [requests x query_len, vocab] a verify graph computes for its
# greedy verification; larger buckets return hidden states only (the LM head runs eagerly).
GREEDY_VERIFY_MAX_LOGITS_BYTES = 256 * 2**20
# Greedy drafts [requests, G] from each request's anchor token and position [requests] and
# the step's block tables by kind (`DrafterProposer.draft_next`).
DraftNext = Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]
# Batch buckets up to this size get greedy versions whose drafting reads narrower block tables
# (`draft_widths`): the drafter attends over every row of the table it is given, so a short
# context would otherwise pay for `max_model_len` rows each step.
NARROW_DRAFT_MAX_BATCH = 16


def draft_widths(full: int) -> list[int]:
    """The block-table widths the drafting of a greedy verify graph is captured for: 1/32,
    1/8 and 1/2 of the full width (at least one block) and the full width."""
    return sorted({max(1, full // 32), max(1, full // 8), max(1, full // 2), full})


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: fine steps where small batches are common, coarser above."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


def prefill_query_lens(max_tokens: int, above: int) -> list[int]:
    """Query lengths of the one-request prefill graphs: the powers of two and 1.5 times each
    (16, 24, 32, 48, ...: a prompt is padded by less than half its length) up to
    `max_tokens` (itself included), those not above `above` (the verify graphs cover them)
    left out."""
    lengths = [16 * 2 ** (i // 2) * (3 if i % 2 else 2) // 2 for i in range(40)]
    chosen = [q for q in lengths if above < q < max_tokens]
    return chosen + [max_tokens] if max_tokens > above and max_tokens >= 16 else chosen


class StepOutputs(NamedTuple):
    """A captured step's outputs: the hidden states of every query row; for verify graphs
    that hold them, the greedy verification and the next drafts."""

    hidden: torch.Tensor
    verified: torch.Tensor | None = None
    next_drafts: torch.Tensor | None = None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 table_widths: dict[str, int], max_batch: int, block_size: int,
                 device: torch.device, query_len: int = 1,
                 greedy_verification: bool = False, draft_next: DraftNext | None = None
                 ) -> None:
        self.model = model
        self.draft_next = draft_next  # drafts after the greedy verification (see above)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.query_len = query_len
        self.buckets = batch_buckets(max_batch)
        size = self.buckets[-1]
        tokens = size * query_len

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        # The inputs are rows of two tensors (per token, per request), so a step fills them
        # in one copy.
        kinds = list(table_widths)
        self.token_rows = zeros(2 + len(kinds), tokens)
        self.input_ids, self.positions = self.token_rows[0], self.token_rows[1]
        self.slots = {kind: self.token_rows[2 + i] for i, kind in enumerate(kinds)}
        self.with_lora = getattr(model, "lora_context", None) is not None
        verifies = greedy_verification and query_len > 1
        self.request_rows = zeros(1 + len(kinds) + verifies + self.with_lora, size)
        self.seq_lens = self.request_rows[0]
        self.seq_lens.fill_(query_len)
        self.first_blocks = {kind: self.request_rows[1 + i] for i, kind in enumerate(kinds)}
        # Verify graphs: each request's real query rows (1 + its drafts), for the greedy
        # verification they hold.
        self.num_query_tokens = self.request_rows[1 + len(kinds)] if verifies else None
        self.lora_slots = self.request_rows[-1] if self.with_lora else None
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)
        self.token_request = torch.arange(size, device=device).repeat_interleave(query_len)
        self.query_start = torch.arange(size + 1, device=device) * query_len
        self.tables = {kind: zeros(size, width) for kind, width in table_widths.items()}
        # What each static table row holds (its first entries; None: not known), so a step
        # rewrites only the rows that changed: at hundreds of requests a whole table is tens
        # of thousands of entries a step, where a decode step changes a few rows.
        self.held_tables: dict[str, list[list[int] | None]] = {
            kind: [None] * size for kind in table_widths}
        self.real_rows = zeros(tokens)  # verify: the padded row of each real token
        self.row_index = torch.arange(tokens, device=device)
        self.host_real_rows: list[int] = []
        # (requests, bucket) of the last step `prepare_chained` filled the buffers with, None
        # after `prepare`: its padding rows are still in place.
        self.chained_layout: tuple[int, int] | None = None
        self.device = device
        # bucket -> (graph, its outputs); `greedy_graphs`: the versions with the greedy
        # verification, for the buckets that hold it, by (bucket, the drafting's table width)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self.greedy_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self.full_width = max(table_widths.values()) if table_widths else 0
        self.replays = 0
        self.verified_replays = 0  # replays whose greedy verification was taken
        self.greedy_replay_widths: Counter[int] = Counter()  # by the drafting's table width

    def _inputs(self, size: int) -> tuple[torch.Tensor, BatchMetadata]:
        tokens = size * self.query_len
        kinds = {kind: KindMetadata(self.slots[kind][:tokens], self.tables[kind][:size],
                                    self.first_blocks[kind][:size]) for kind in self.slots}
        meta = BatchMetadata(
            positions=self.positions[:tokens], token_request=self.token_request[:tokens],
            query_start=self.query_start[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=self.query_len, kinds=kinds, block_size=self.block_size,
            lora_slots=self.lora_slots[:size] if self.lora_slots is not None else None)
        return self.input_ids[:tokens], meta

    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """Capture every bucket's graph, into the memory pool `pool` if given (graphs that
        never replay at once may share one: capture the largest first)."""
        start = time.perf_counter()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory the larger ones took.
        for size in reversed(self.buckets):
            self.graphs[size] = self._capture_step(size, False, pool)
            if self._verifies(size):
                for width in self._draft_widths(size):
                    self.greedy_graphs[size, width] = self._capture_step(size, True, pool,
                                                                         width)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %s batches of %s in %.1f s",
                    "decode" if self.query_len == 1 else f"{self.query_len}-token",
                    ", ".join(map(str, self.buckets)), time.perf_counter() - start)

    def _draft_widths(self, size: int) -> list[int]:
        """The drafting table widths bucket `size`'s greedy versions are captured for."""
        if self.draft_next is None or size > NARROW_DRAFT_MAX_BATCH:
            return [self.full_width]
        return draft_widths(self.full_width)

    def _capture_step(self, size: int, greedy: bool, pool: tuple, width: int | None = None
                      ) -> tuple[torch.cuda.CUDAGraph, StepOutputs]:
        # The warm-up run compiles kernels and settles allocations outside the capture.
        self._step(size, greedy, width)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            # Fresh metadata for the capture: kernels may keep views of a step on it
            # (`BatchMetadata.per_token`), and the warm-up's live outside the graph's memory.
            outputs = self._step(size, greedy, width)
        return graph, outputs

    def _step(self, size: int, greedy: bool, width: int | None = None) -> StepOutputs:
        """What a graph of bucket `size` holds: the forward over the static inputs, and in
        the greedy version, the greedy verification and the next drafts, made over the
        first `width` blocks of each table."""
        input_ids, meta = self._inputs(size)
        hidden = self.model(input_ids, meta, self.kv_caches)
        if not greedy:
            return StepOutputs(hidden)
        verified = self._greedy_verification(hidden, input_ids, size)
        if self.draft_next is None:
            return StepOutputs(hidden, verified)
        # Each request's last emitted token, one position past its accepted drafts (its
        # first query row holds the token before them).
        accepted = verified[:, 0]
        anchors = verified[:, 1:].gather(1, accepted[:, None]).squeeze(1)
        positions = meta.positions.view(size, self.query_len)[:, 0] + accepted + 1
        tables = {kind: table[:size, :width] for kind, table in self.tables.items()}
        return StepOutputs(hidden, verified, self.draft_next(anchors, positions, tables))

    def _verifies(self, size: int) -> bool:
        """Whether bucket `size`'s graph holds the greedy verification."""
        logits_bytes = size * self.query_len * self.model.config.vocab_size * 4
        return self.num_query_tokens is not None \
            and logits_bytes <= GREEDY_VERIFY_MAX_LOGITS_BYTES

    def _greedy_verification(self, hidden: torch.Tensor, input_ids: torch.Tensor, size: int
                             ) -> torch.Tensor:
        best = self.model.compute_logits(hidden).argmax(dim=-1)
        q = self.query_len
        return verify_greedy_rows(best.view(size, q), input_ids.view(size, q),
                                  self.num_query_tokens[:size])

    def covers(self, batch: HostBatch) -> bool:
        # A step of one token per request takes the decode graphs, not the verify ones.
        if batch.lora_slots is not None and not self.with_lora:
            return False
        return ((batch.max_query_len == 1) == (self.query_len == 1)
                and batch.max_query_len <= self.query_len
                and batch.num_requests <= self.buckets[-1]
                and all(batch.table_width(kind) <= table.shape[1]
                        for kind, table in self.tables.items()))

    def prepare(self, batch: HostBatch) -> int | None:
        """Copy a step's metadata into the static buffers, padded to its bucket.

        Returns the bucket size, or None when the graphs do not cover the step."""
        if not self.covers(batch):
            return None
        self.chained_layout = None  # the padding rows are rewritten below
        count = batch.num_requests
        size = next(s for s in self.buckets if s >= count)
        pad = [0] * (size - count)
        if self.query_len == 1:
            token_rows = [batch.input_ids + pad, batch.positions + pad]
            token_rows += [batch.slots[kind] + pad for kind in self.slots]
            seq_lens = batch.seq_lens + [1] * len(pad)
            real_rows = []
        else:
            token_rows, seq_lens, real_rows = self._padded_queries(batch, size)
        request_rows = [seq_lens] + [batch.first_blocks[kind] + pad for kind in self.slots]
        if self.num_query_tokens is not None:
            starts = batch.query_start
            request_rows.append([end - start for start, end in zip(starts, starts[1:])]
                                + [1] * len(pad))
        if self.with_lora:
            request_rows.append((batch.lora_slots or [-1] * count) + [-1] * len(pad))
        changes = {kind: self._changed_rows(batch.tables[kind] + [[0]] * len(pad), kind)
                   for kind in self.tables}
        tokens = size * self.query_len
        staged = to_device([value for row in token_rows + request_rows for value in row]
                           + [value for rows, values in changes.values() for value in rows + values]
                           + real_rows, self.device)
        offset = len(token_rows) * tokens
        self.token_rows[:, :tokens].copy_(staged[:offset].view(len(token_rows), tokens))
        self.request_rows[:, :size].copy_(
            staged[offset:offset + len(request_rows) * size].view(len(request_rows), size))
        offset = self._copy_table_rows(changes, staged, offset + len(request_rows) * size)
        self.real_rows[:len(real_rows)].copy_(staged[offset:])
        self.host_real_rows = real_rows
        return size

    def prepare_chained(self, batch: ChainedBatch) -> int | None:
        """`prepare` for a verify step made on the device (`ChainedBatch`): its rows are
        copied from its tensors (two copies: its rows are laid out as the buffers), the
        padding rows written as `prepare` writes them, only where the last step prepared
        here was not a chained one of as many requests in the same bucket (the padding is
        then already there). Returns the bucket size, or None when the graphs do not cover
        the step."""
        count, q = batch.num_requests, batch.query_len
        if (q != self.query_len or count > self.buckets[-1]
                or any(batch.table_width(kind) > table.shape[1]
                       for kind, table in self.tables.items())):
            return None
        if batch.kinds != list(self.slots):
            raise ValueError(f"the chained step's kinds {batch.kinds} are not the graphs' "
                             f"{list(self.slots)}")
        size = next(s for s in self.buckets if s >= count)
        real, tokens = count * q, size * q
        self.token_rows[:, :real].copy_(batch.token_rows)
        self.request_rows[:batch.request_rows.shape[0], :count].copy_(batch.request_rows)
        if self.chained_layout != (count, size):
            # Padding requests: token 0 at positions 0 .. q - 1 of the null block.
            self.token_rows[:, real:tokens].zero_()
            self.positions[real:tokens].copy_(self.row_index[:tokens - real] % q)
            self.seq_lens[count:size].fill_(q)
            for first in self.first_blocks.values():
                first[count:size].zero_()
            if self.num_query_tokens is not None:
                self.num_query_tokens[:count].fill_(q)
                self.num_query_tokens[count:size].fill_(1)
            if self.lora_slots is not None:
                self.lora_slots[:size].fill_(-1)
            self.real_rows[:real].copy_(self.row_index[:real])
            self.host_real_rows = list(range(real))
            self.chained_layout = (count, size)
        pad = [[0]] * (size - count)
        changes = {kind: self._changed_rows(batch.host_tables[kind] + pad, kind)
                   for kind in self.tables}
        if any(rows for rows, _ in changes.values()):
            self._copy_table_rows(changes, to_device(
                [value for rows, values in changes.values() for value in rows + values],
                self.device), 0)
        return size

    def _copy_table_rows(self, changes: dict[str, tuple[list[int], list[int]]],
                         staged: torch.Tensor, offset: int) -> int:
        """Write `_changed_rows`' rows of every kind, staged on the device from `offset`
        (each kind's row indices, then their entries); returns the offset past them."""
        for kind, (rows, values) in changes.items():
            if rows:
                width = len(values) // len(rows)
                self.tables[kind][:, :width].index_copy_(
                    0, staged[offset:offset + len(rows)],
                    staged[offset + len(rows):offset + len(rows) + len(values)]
                    .view(len(rows), width))
            offset += len(rows) + len(values)
        return offset

    def _changed_rows(self, tables: list[list[int]], kind: str) -> tuple[list[int], list[int]]:
        """The rows of `tables` (a step's, padding rows included) that the static buffer of
        `kind` does not hold yet, and their entries padded to the longest of them. Entries
        past a row's own are left as they were: attention masks them by position, so stale
        block ids there are never read."""
        held = self.held_tables[kind]
        rows = [i for i, table in enumerate(tables) if held[i] != table]
        if not rows:
            return [], []
        width = max(len(tables[i]) for i in rows)
        values = []
        for i in rows:
            table = tables[i]
            values += table + [0] * (width - len(table))
            held[i] = table
        return rows, values

    def input_rows(self, indices: list[int]) -> list[int]:
        """The rows of `input_ids` that hold the last prepared step's tokens at `indices`."""
        if self.query_len == 1:
            return indices
        return [self.host_real_rows[i] for i in indices]

    def _padded_queries(self, batch: HostBatch, size: int
                        ) -> tuple[list[list[int]], list[int], list[int]]:
        """Per-token rows with every request's tokens padded to `query_len`, the padded
        context lengths, and the padded row of each real token."""
        q, starts = self.query_len, batch.query_start
        input_ids, positions, real_rows = [], [], []
        slots: dict[str, list[int]] = {kind: [] for kind in self.slots}
        seq_lens = []
        for r in range(size):
            first, end = (starts[r], starts[r + 1]) if r < batch.num_requests else (0, 0)
            extra = q - (end - first)
            input_ids += batch.input_ids[first:end] + [0] * extra
            last = batch.positions[end - 1] if end > first else -1
            positions += batch.positions[first:end] + list(range(last + 1, last + 1 + extra))
            for kind, rows in slots.items():
                rows += batch.slots[kind][first:end] + [0] * extra
            seq_lens.append(last + 1 + extra)
            real_rows += range(r * q, r * q + end - first)
        return [input_ids, positions, *slots.values()], seq_lens, real_rows

    def replay(self, size: int, batch: HostBatch) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step `prepare` filled the buffers for.

        The result is a view of the graph's output, valid until the next replay (or, for
        verify graphs, a gather of its real rows)."""
        graph, outputs = self.graphs[size]
        graph.replay()
        self.replays += 1
        if self.query_len == 1:
            return outputs.hidden[:batch.num_requests]
        return outputs.hidden.index_select(0, self.real_rows[:batch.num_tokens])

    def replay_greedy(self, size: int, count: int, width: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay the greedy version of bucket `size` for the `count` requests `prepare`
        filled it with: their greedy verification [count, 1 + query_len]
        (`verify_greedy_rows`) and the next drafts [count, G] made after it (None without
        `draft_next`), views of the graph's outputs valid until its next replay. `width`: the
        widest block table of the step (None: any); the version whose drafting reads the
        fewest blocks that hold it replays. None, with nothing replayed, where the bucket has
        no greedy version."""
        widths = [w for s, w in self.greedy_graphs if s == size
                  and (width is None or w >= width)]
        if not widths:
            return None
        chosen = min(widths) if width is not None else max(widths)
        graph, outputs = self.greedy_graphs[size, chosen]
        self.greedy_replay_widths[chosen] += 1
        graph.replay()
        self.replays += 1
        self.verified_replays += 1
        drafts = outputs.next_drafts
        return outputs.verified[:count], drafts[:count] if drafts is not None else None

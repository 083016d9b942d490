"""CUDA graphs for decode steps.

A decode step runs a few dozen small kernels per layer; at small batches the GPU finishes each
in microseconds and the host's launches set the pace. So the decode forward of each batch-size
bucket is captured once at start-up, over static input buffers, and a step copies its
metadata into the first rows of the smallest bucket that holds it and replays the graph.

Padding rows decode token 0 at position 0 against the null block (block 0 of every pool),
whose slot they also write: real requests never read the null block unmasked, so padding
changes nothing they see. Steps the graphs do not cover (prefill chunks, batches larger than
the largest bucket, block tables wider than captured) run eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from muse.engine.metadata import HostBatch
from muse.kernels.attention_metadata import BatchMetadata, KindMetadata
from muse.engine.transfer import to_device

logger = logging.getLogger("muse")


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: fine steps where small batches are common, coarser above."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 1025, 32))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 table_widths: dict[str, int], max_batch: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.buckets = batch_buckets(max_batch)
        size = self.buckets[-1]

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        # The per-request inputs are rows of one tensor, so a step fills them in one copy.
        kinds = list(table_widths)
        self.rows = zeros(3 + 2 * len(kinds), size)
        self.input_ids, self.positions, self.seq_lens = self.rows[0], self.rows[1], self.rows[2]
        self.seq_lens.fill_(1)
        self.slots = {kind: self.rows[3 + 2 * i] for i, kind in enumerate(kinds)}
        self.first_blocks = {kind: self.rows[4 + 2 * i] for i, kind in enumerate(kinds)}
        self.token_request = torch.arange(size, device=device)
        self.query_start = torch.arange(size + 1, device=device)
        self.tables = {kind: zeros(size, width) for kind, width in table_widths.items()}
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    def _inputs(self, size: int) -> tuple[torch.Tensor, BatchMetadata]:
        kinds = {kind: KindMetadata(self.slots[kind][:size], self.tables[kind][:size],
                                    self.first_blocks[kind][:size]) for kind in self.slots}
        meta = BatchMetadata(
            positions=self.positions[:size], token_request=self.token_request[:size],
            query_start=self.query_start[:size + 1], seq_lens=self.seq_lens[:size],
            max_query_len=1, kinds=kinds, block_size=self.block_size)
        return self.input_ids[:size], meta

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the memory the larger ones took.
        for size in reversed(self.buckets):
            input_ids, meta = self._inputs(size)
            # The warm-up run compiles kernels and settles allocations outside the capture.
            self.model(input_ids, meta, self.kv_caches)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(input_ids, meta, self.kv_caches)
            self.graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for decode batches of %s in %.1f s",
                    ", ".join(map(str, self.buckets)), time.perf_counter() - start)

    def covers(self, batch: HostBatch) -> bool:
        return (batch.is_decode and batch.num_requests <= self.buckets[-1]
                and all(batch.table_width(kind) <= table.shape[1]
                        for kind, table in self.tables.items()))

    def prepare(self, batch: HostBatch) -> int | None:
        """Copy a decode step's metadata into the static buffers, padded to its bucket.

        Returns the bucket size, or None when the graphs do not cover the step."""
        if not self.covers(batch):
            return None
        count = batch.num_requests
        size = next(s for s in self.buckets if s >= count)
        pad = [0] * (size - count)
        rows = [batch.input_ids + pad, batch.positions + pad, batch.seq_lens + [1] * len(pad)]
        for kind in self.slots:
            rows += [batch.slots[kind] + pad, batch.first_blocks[kind] + pad]
        # Only the table columns this step uses are rewritten: entries past a request's length
        # are masked by position, so stale block ids there are never read.
        widths = {kind: batch.table_width(kind) for kind in self.tables}
        tables = [value for kind, width in widths.items()
                  for table in batch.tables[kind] + [[]] * len(pad)
                  for value in table + [0] * (width - len(table))]
        staged = to_device([value for row in rows for value in row] + tables, self.device)
        self.rows[:, :size].copy_(staged[:len(rows) * size].view(len(rows), size))
        offset = len(rows) * size
        for kind, width in widths.items():
            self.tables[kind][:size, :width].copy_(
                staged[offset:offset + size * width].view(size, width))
            offset += size * width
        return size

    def replay(self, size: int, count: int) -> torch.Tensor:
        """Hidden states [count, hidden] of the step `prepare` filled the buffers for.

        The result is a view of the graph's output, valid until the next replay."""
        graph, hidden = self.graphs[size]
        graph.replay()
        self.replays += 1
        return hidden[:count]

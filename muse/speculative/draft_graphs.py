"""CUDA graphs for the draft pass.

The drafter's block pass and its left-to-right walk over the draft slots are a few hundred
small kernels; at small batches launching them would take longer than running them. So the
pass over the paged context rows is captured per batch-size bucket over static buffers,
with block tables as wide as `max_model_len` needs, and a step copies its anchors, positions,
temperatures and tables in and replays. Padding rows draft from token 0 at position 0, whose
context is empty. A request that draws with its own generator (a seeded request with
probabilistic drafts) runs eagerly: a graph replays the default generator's stream.
"""

from __future__ import annotations

import logging
import time

import torch

from muse.engine.cuda_graphs import batch_buckets
from muse.engine.transfer import to_device
from muse.speculative.draft_kv import DraftKV
from muse.speculative.drafter import DraftProposal

logger = logging.getLogger("muse")


class DraftGraphs:
    def __init__(self, kv: DraftKV, max_batch: int, table_width: int, device: torch.device,
                 greedy: bool = False) -> None:
        self.kv = kv
        self.greedy = greedy  # every draft the argmax (no q), as `draft_sample_method` greedy
        self.buckets = batch_buckets(max_batch)
        size = self.buckets[-1]
        self.rows = torch.zeros(2, size, dtype=torch.long, device=device)
        self.anchors, self.positions = self.rows[0], self.rows[1]
        self.tables = torch.zeros(size, table_width, dtype=torch.long, device=device)
        self.temperatures = torch.zeros(size, dtype=torch.float32, device=device)
        self.device = device
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, DraftProposal]] = {}
        self.replays = 0

    def _propose(self, size: int) -> DraftProposal:
        return self.kv.propose(self.anchors[:size], self.positions[:size], self.tables[:size],
                               None if self.greedy else self.temperatures[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            self._propose(size)  # compiles kernels and fills the drafter's rotary cache
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                proposal = self._propose(size)
            self.graphs[size] = (graph, proposal)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for draft batches of %s in %.1f s",
                    ", ".join(map(str, self.buckets)), time.perf_counter() - start)

    def covers(self, num_requests: int, table_width: int) -> bool:
        return num_requests <= self.buckets[-1] and table_width <= self.tables.shape[1]

    def prepare(self, anchors: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
                tables: list[list[int]], temperatures: list[float]) -> int:
        """Copy `len(tables)` requests' inputs (which `covers`) into the static buffers;
        returns their bucket. Anchors and positions may already be on the device (drafts
        queued before the step that decides them is read back)."""
        count = len(tables)
        size = next(s for s in self.buckets if s >= count)
        width = max(len(table) for table in tables)
        # Table entries past a request's context are masked by position: stale ones are fine.
        flat_tables = [b for table in tables for b in table + [0] * (width - len(table))]
        if isinstance(anchors, torch.Tensor):
            # Padding rows keep whatever an earlier step left: their drafts are never read.
            self.anchors[:count].copy_(anchors)
            self.positions[:count].copy_(positions)
            staged = to_device(flat_tables, self.device)
        else:
            pad = [0] * (size - count)
            staged = to_device(anchors + pad + positions + pad + flat_tables, self.device)
            self.rows[:, :size].copy_(staged[:2 * size].view(2, size))
            staged = staged[2 * size:]
        self.tables[:count, :width].copy_(staged.view(count, width))
        if not self.greedy:
            self.temperatures[:count].copy_(to_device(temperatures, self.device, torch.float32))
        return size

    def replay(self, size: int, count: int) -> DraftProposal:
        """The drafts of the `count` requests `prepare` filled bucket `size` with: views of
        the graph's outputs, valid until the next replay."""
        graph, proposal = self.graphs[size]
        graph.replay()
        self.replays += 1
        probs, confidence = proposal.probs, proposal.confidence
        return DraftProposal(proposal.tokens[:count],
                             probs[:count] if probs is not None else None,
                             confidence[:count] if confidence is not None else None)

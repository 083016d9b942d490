"""A worker that answers greedy verify steps as a verify CUDA graph does, on any device: the
step's logits are laid out a request a row, padded past each request's own rows with rows
that would extend its accepted run if they were counted, verified by `verify_greedy_rows`,
and (with a drafter) followed by the next drafts made from that verification as the graph
makes them (`DrafterProposer.draft_next`). Verify steps made on the device from the step
before (`ModelWorker.execute_chained`) are answered the same way. What the engine then does
with the answer is the graph path's, without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from muse.engine.worker import GreedyVerified, ModelWorker
from muse.speculative.verification import verify_greedy_rows


class GraphLayoutWorker:
    """Patches `ModelWorker` for the test's lifetime; `asked` counts the steps answered so."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, draft: bool) -> None:
        self.draft = draft
        self.proposer: Any = None  # set to the engine's proposer to draft
        self.asked: list[int] = []
        self._ids: torch.Tensor | None = None
        real_execute, real_fill = ModelWorker.execute, ModelWorker._fill_pending
        layout = self

        def fill(worker, input_ids, pending, previous_tokens):
            real_fill(worker, input_ids, pending, previous_tokens)
            layout._ids = input_ids

        def execute(worker, batch, logits_rows, pending=([], []), previous_tokens=None,
                    greedy_verify=False):
            logits = real_execute(worker, batch, logits_rows, pending, previous_tokens)
            if not greedy_verify:
                return logits
            assert logits_rows == list(range(batch.num_tokens))
            return layout.answer(batch, logits)

        real_chained = ModelWorker.execute_chained

        def execute_chained(worker, batch):
            logits = real_chained(worker, batch)
            q = batch.query_len
            layout._ids = batch.input_ids
            starts = list(range(0, batch.num_tokens + 1, q))
            return layout.answer(batch, logits, starts, batch.positions[::q],
                                 {kind: table for kind, table in batch.tables.items()})

        monkeypatch.setattr(ModelWorker, "_fill_pending", fill)
        monkeypatch.setattr(ModelWorker, "execute", execute)
        monkeypatch.setattr(ModelWorker, "execute_chained", execute_chained)

    def answer(self, batch: Any, logits: torch.Tensor, starts: list[int] | None = None,
               first_positions: torch.Tensor | None = None,
               tables: dict[str, torch.Tensor] | None = None) -> GreedyVerified:
        """`starts`, `first_positions` and `tables` for a chained step (`ChainedBatch`); a
        `HostBatch` gives its own."""
        self.asked.append(batch.num_requests)
        starts = batch.query_start if starts is None else starts
        ids = self._ids
        width = max(end - start for start, end in zip(starts, starts[1:])) + 2
        best = torch.zeros(batch.num_requests, width, dtype=torch.long)
        padded = torch.zeros(batch.num_requests, width, dtype=torch.long)
        for r, (start, end) in enumerate(zip(starts, starts[1:])):
            best[r, :end - start] = logits[start:end].argmax(dim=-1)
            padded[r, :end - start] = ids[start:end]
            padded[r, end - start:] = best[r, end - start - 1]  # would match if counted
        counts = torch.tensor([end - start for start, end in zip(starts, starts[1:])])
        verified = verify_greedy_rows(best, padded, counts)
        if not self.draft:
            return GreedyVerified(verified)
        accepted = verified[:, 0]
        anchors = verified[:, 1:].gather(1, accepted[:, None]).squeeze(1)
        if first_positions is None:
            first_positions = torch.tensor([batch.positions[s] for s in starts[:-1]])
        positions = first_positions + accepted + 1
        if tables is None:
            tables = {kind: torch.tensor([t + [0] * (batch.table_width(kind) - len(t))
                                          for t in rows])
                      for kind, rows in batch.tables.items()}
        return GreedyVerified(verified, self.proposer.draft_next(anchors, positions, tables))

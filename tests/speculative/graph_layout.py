"""A worker that answers greedy verify steps as a verify CUDA graph does, on any device: the
step's logits are laid out a request a row, padded past each request's own rows with rows
that would extend its accepted run if they were counted, verified by `verify_greedy_rows`,
and (with a drafter) followed by the next drafts made from that verification as the graph
makes them (`DrafterProposer.draft_next`). What the engine then does with the answer is the
graph path's, without a GPU."""

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

        monkeypatch.setattr(ModelWorker, "_fill_pending", fill)
        monkeypatch.setattr(ModelWorker, "execute", execute)

    def answer(self, batch: Any, logits: torch.Tensor) -> GreedyVerified:
        self.asked.append(batch.num_requests)
        starts, ids = batch.query_start, self._ids
        width = batch.max_query_len + 2
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
        positions = torch.tensor([batch.positions[s] for s in starts[:-1]]) + accepted + 1
        tables = {kind: torch.tensor([t + [0] * (batch.table_width(kind) - len(t))
                                      for t in rows]) for kind, rows in batch.tables.items()}
        return GreedyVerified(verified, self.proposer.draft_next(anchors, positions, tables))

"""One rank's share of a step: its model shard runs the step's batch against its KV tensors.

A worker knows nothing of requests: it gets a `HostBatch` (token ids, positions, cache slots
and block tables, identical on every rank) and the rows whose logits the step needs, and
returns those logits. With tensor parallelism every rank runs the same calls, so their
collectives meet; the driver (rank 0) also samples.
"""

from __future__ import annotations

import torch

from muse.distributed.parallel_state import get_pp_group
from muse.engine.cuda_graphs import DecodeGraphs
from muse.engine.metadata import HostBatch
from muse.engine.transfer import to_device
from muse.model.decoder import EngineModel

# Input positions still on the device (sampled by the step before, not read back), and the
# rows of that step's token tensor that hold them.
PendingInputs = tuple[list[int], list[int]]


class ModelWorker:
    def __init__(self, model: EngineModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, block_size: int,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        self.decode_graphs = decode_graphs

    @torch.inference_mode()
    def execute(self, batch: HostBatch, logits_rows: list[int],
                pending: PendingInputs = ([], []),
                previous_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [len(logits_rows), vocab] (float32) of the step's tokens at those rows, on
        the first and the last pipeline stage (None on the stages between)."""
        if get_pp_group().world_size > 1:
            return self._execute_stage(batch, logits_rows)
        return self._logits(self._forward(batch, pending, previous_tokens), logits_rows)

    def _logits(self, hidden: torch.Tensor, logits_rows: list[int]) -> torch.Tensor:
        if not logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        if logits_rows != list(range(hidden.shape[0])):
            hidden = hidden[to_device(logits_rows, self.device)]
        return self.model.compute_logits(hidden)

    def _execute_stage(self, batch: HostBatch, logits_rows: list[int]) -> torch.Tensor | None:
        """One pipeline stage: the previous stage's (hidden, residual) in, ours out to the
        next; the last stage's logits go back to the first, which samples."""
        stages, model = get_pp_group(), self.model
        input_ids, meta = batch.to_device(self.device, self.block_size)
        intermediate = None
        if not model.is_first_stage:
            shape = (input_ids.shape[0], model.config.hidden_size)
            dtype = next(model.parameters()).dtype
            intermediate = (stages.recv(shape, dtype, stages.prev_rank, self.device),
                            stages.recv(shape, dtype, stages.prev_rank, self.device))
        out = model(input_ids, meta, self.kv_caches, intermediate=intermediate)
        last = stages.world_size - 1
        logits_shape = (len(logits_rows), model.config.vocab_size)
        if not model.is_last_stage:
            hidden, residual = out
            stages.send(hidden, stages.next_rank)
            stages.send(residual, stages.next_rank)
            if model.is_first_stage and logits_rows:
                return stages.recv(logits_shape, torch.float32, last, self.device)
            return None
        logits = self._logits(out, logits_rows)
        if logits_rows:
            stages.send(logits, 0)
        return logits

    def _forward(self, batch: HostBatch, pending: PendingInputs,
                 previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states of the step's tokens: a captured graph when one fits."""
        if self.decode_graphs is not None:
            size = self.decode_graphs.prepare(batch)
            if size is not None:
                self._fill_pending(self.decode_graphs.input_ids, pending, previous_tokens)
                return self.decode_graphs.replay(size, batch.num_requests)
        input_ids, meta = batch.to_device(self.device, self.block_size)
        self._fill_pending(input_ids, pending, previous_tokens)
        return self.model(input_ids, meta, self.kv_caches)

    def _fill_pending(self, input_ids: torch.Tensor, pending: PendingInputs,
                      previous_tokens: torch.Tensor | None) -> None:
        """Write the previous step's sampled tokens into this step's input ids, on the device."""
        targets, sources = pending
        if not targets:
            return
        if targets == sources == list(range(len(targets))):
            # Steady decoding: the same requests in the same order, no index tensors needed.
            input_ids[:len(targets)].copy_(previous_tokens[:len(targets)])
            return
        index = to_device([targets, sources], self.device)
        input_ids.index_copy_(0, index[0], previous_tokens.index_select(0, index[1]))

"""One rank's share of a step: its model shard runs the step's batch against its KV tensors.

A worker knows nothing of requests: it gets a `HostBatch` (token ids, positions, cache slots
and block tables, identical on every rank; the media slices of a step with media) and the
rows whose logits the step needs, and returns those logits. With tensor parallelism every
rank runs the same calls, so their collectives meet; the driver (rank 0) also samples.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from itertools import accumulate
from typing import NamedTuple

import torch

from muse.distributed.config import RankCoordinates
from muse.distributed.parallel_state import (get_dp_group, get_parallel_config, get_pcp_group,
                                             get_pp_group, get_world_group)
from muse.engine.cuda_graphs import DecodeGraphs
from muse.engine.host_kv_store import HostKVStore
from muse.engine.metadata import HostBatch
from muse.engine.piecewise_graphs import PiecewiseGraphs
from muse.engine.transfer import to_device
from muse.kernels.attention_metadata import ContextParallelMetadata
from muse.model.decoder import EngineModel
from muse.multimodal.encoder_cache import EncoderCache
from muse.multimodal.engine_inputs import MediaEncoders, scatter_media
from muse.speculative.chained_step import ChainedBatch

# Input positions still on the device (sampled by the step before and not read back, or
# drafts left there by the drafter), and the rows of the tensor that holds them.
PendingInputs = tuple[list[int], list[int]]


class GreedyVerified(NamedTuple):
    """What a verify step returns in place of logits when its CUDA graph verified it
    greedily: per request the accepted count, then the argmax token of each of its query
    rows ([requests, 1 + query_len], `verify_greedy_rows`), and the next step's greedy drafts
    [requests, G] when the graph also drafted (None otherwise); views of the graph's outputs."""

    rows: torch.Tensor
    next_drafts: torch.Tensor | None = None


class ModelWorker:
    def __init__(self, model: EngineModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 device: torch.device, block_size: int,
                 graphs: list[DecodeGraphs] | None = None,
                 encoders: MediaEncoders | None = None,
                 encoder_cache: EncoderCache | None = None,
                 host_store: HostKVStore | None = None,
                 piecewise: PiecewiseGraphs | None = None) -> None:
        self.model = model
        # This rank's host-memory (and disk) KV tiers, when the engine has them; their loads
        # land layer group by layer group inside eager forwards.
        self.host_store = host_store
        if host_store is not None:
            model.layer_hooks.append(host_store)
        # The image / audio encoders (when the model has them) and the cache of their outputs.
        self.encoders = encoders
        self.encoder_cache = encoder_cache
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = block_size
        # Captured steps by query length: decode (1), then speculative verify shapes.
        self.graphs = sorted(graphs or [], key=lambda g: g.query_len)
        # Steps no whole-step graph covers, up to its largest bucket (`piecewise_graphs.py`).
        self.piecewise = piecewise
        # Every step eager: a KV connector's per-layer hooks must run in each forward.
        self.eager_layers = False
        # Pipeline steps run, by their number of micro-batches.
        self.micro_batch_steps: Counter[int] = Counter()
        self.context_parallel_steps = 0  # steps whose tokens were split over the PCP ranks

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.graphs[0] if self.graphs and self.graphs[0].query_len == 1 else None

    @torch.inference_mode()
    def execute_data_parallel(self, batch: HostBatch | None, num_tokens: list[int],
                              logits_rows: list[list[int]]) -> list[torch.Tensor | None]:
        """Every rank's call for one step of all data-parallel ranks: `batch` is this rank's
        DP rank's batch (None: it has nothing to run), `num_tokens[d]` and `logits_rows[d]`
        DP rank d's token count (0 when idle) and logits rows. Returns every DP rank's
        logits on the driver (world rank 0), which receives them from each DP rank's first
        rank; elsewhere a list of None.

        With experts spread over DP ranks an idle rank runs a one-token dummy batch, so the
        MoE collectives of the busy ones meet."""
        dp = get_dp_group()
        rows = logits_rows[dp.rank_in_group]
        rearm_kv_scales = False
        if dp.world_size > 1 and get_parallel_config().enable_expert_parallel:
            if batch is None:
                kinds = list(dict.fromkeys(self.model.config.layer_types))
                batch, rows = HostBatch.dummy(kinds), []
                # The dummy token must not set the FP8 KV scales: the next real step does.
                rearm_kv_scales = self.model.kv_scales_pending
            batch.dp_num_tokens = [count or 1 for count in num_tokens]
        logits = self.execute(batch, rows) if batch is not None else None
        if rearm_kv_scales:
            self.model.calculate_kv_scales_on_next_step()
        if dp.world_size == 1:
            return [logits]
        return self._gather_logits(logits, logits_rows)

    def _gather_logits(self, logits: torch.Tensor | None, logits_rows: list[list[int]]
                       ) -> list[torch.Tensor | None]:
        """Each DP rank's logits, sent by its first rank to the driver."""
        world, config = get_world_group(), get_parallel_config()
        me = config.coordinates(world.rank_in_group)
        vocab = self.model.config.vocab_size
        if world.rank_in_group != 0:
            if me.pp == me.pcp == me.tp == 0 and logits_rows[me.dp]:
                world.send(logits, 0)
            return [None] * len(logits_rows)
        gathered: list[torch.Tensor | None] = [logits]
        for dp_rank, rows in enumerate(logits_rows[1:], start=1):
            source = config.rank_of(RankCoordinates(dp=dp_rank, pp=0, pcp=0, tp=0))
            gathered.append(world.recv((len(rows), vocab), torch.float32, source, self.device)
                            if rows else None)
        return gathered

    @torch.inference_mode()
    def execute(self, batch: HostBatch, logits_rows: list[int],
                pending: PendingInputs = ([], []),
                previous_tokens: torch.Tensor | None = None,
                greedy_verify: bool = False) -> torch.Tensor | GreedyVerified | None:
        """Logits [len(logits_rows), vocab] (float32) of the step's tokens at those rows, on
        the first and the last pipeline stage (None on the stages between). The step's
        copies between KV tiers come first. `greedy_verify`: the step is greedy verification
        of every request's drafts (all its rows wanted); a verify graph that holds it
        returns `GreedyVerified` instead of logits."""
        if batch.kv_transfers:
            self.host_store.apply(batch.kv_transfers)
        if get_pp_group().world_size > 1:
            # Only the first stage reads embeddings, so only it scatters the media rows.
            logits = self._execute_stage(batch, logits_rows)
        elif batch.media:
            logits = self._logits(self._forward_media(batch, pending, previous_tokens),
                                  logits_rows)
        else:
            out = self._forward(batch, pending, previous_tokens, greedy_verify)
            logits = out if isinstance(out, GreedyVerified) else self._logits(out, logits_rows)
        if self.host_store is not None and self.host_store.pending:
            raise RuntimeError("host-tier loads were left pending after a forward pass")
        return logits

    @torch.inference_mode()
    def execute_chained(self, batch: ChainedBatch) -> torch.Tensor | GreedyVerified:
        """A verify step made on the device from the one before (`ChainedBatch`), every row
        verified greedily: its graph's greedy verification where a graph holds it, else the
        logits of all its rows."""
        if batch.kv_transfers:
            self.host_store.apply(batch.kv_transfers)
        if not self.eager_layers and not self.model.kv_scales_pending:
            for graphs in self.graphs:
                size = graphs.prepare_chained(batch)
                if size is not None:
                    if self.host_store is not None:
                        self.host_store.finish_loads()
                    verified = graphs.replay_greedy(size, batch.num_requests,
                                                    _widest_table(batch))
                    if verified is not None:
                        return GreedyVerified(*verified)
                    return self.model.compute_logits(graphs.replay(size, batch))
        hidden = self.model(batch.input_ids, batch.metadata(), self.kv_caches)
        return self.model.compute_logits(hidden)

    def _logits(self, hidden: torch.Tensor, logits_rows: list[int]) -> torch.Tensor:
        if not logits_rows:
            return hidden.new_empty(0, 0, dtype=torch.float32)
        if logits_rows != list(range(hidden.shape[0])):
            hidden = hidden[to_device(logits_rows, self.device)]
        return self.model.compute_logits(hidden)

    def _execute_stage(self, batch: HostBatch, logits_rows: list[int]) -> torch.Tensor | None:
        """One pipeline stage over up to `pp` micro-batches (forward-only GPipe): for each in
        turn, the previous stage's (hidden, residual) in, this stage's layers, the result out
        to the next stage without waiting for it to be received, so stage k runs micro-batch
        i + 1 while stage k + 1 runs i. The last stage's logits go back to the first, which
        samples; both return them in `logits_rows` order."""
        stages, model = get_pp_group(), self.model
        parts = batch.split(stages.world_size)
        self.micro_batch_steps[len(parts)] += 1
        part_rows, order = self._micro_batch_rows([tokens for _, tokens in parts], logits_rows)
        dtype = next(model.parameters()).dtype
        # Sent tensors stay referenced by their handles until the waits below; every send is
        # non-blocking so no stage waits for a slower peer to post the matching receive (gloo
        # send blocks until matched), and each stage issues its ops in micro-batch order.
        sends: list[torch.distributed.Work] = []
        logits: list[torch.Tensor] = []
        embeds = self._media_embeds(batch) if batch.media and model.is_first_stage else None
        for (part, tokens), rows in zip(parts, part_rows):
            input_ids, meta = part.to_device(self.device, self.block_size)
            intermediate = None
            if not model.is_first_stage:
                shape = (len(tokens), model.config.hidden_size)
                intermediate = (stages.recv(shape, dtype, stages.prev_rank, self.device),
                                stages.recv(shape, dtype, stages.prev_rank, self.device))
            out = model(input_ids, meta, self.kv_caches, intermediate=intermediate,
                        inputs_embeds=embeds[tokens.start:tokens.stop]
                        if embeds is not None else None)
            if not model.is_last_stage:
                sends += [stages.isend(x, stages.next_rank) for x in out]
            elif rows:
                logits.append(self._logits(out, rows))
                sends.append(stages.isend(logits[-1], 0))
        if model.is_first_stage:
            # Posted only after every micro-batch went out: the last stage sends these logits
            # after receiving those micro-batches.
            last, vocab = stages.world_size - 1, model.config.vocab_size
            logits = [stages.recv((len(rows), vocab), torch.float32, last, self.device)
                      for rows in part_rows if rows]
        for work in sends:
            work.wait()
        if not (model.is_first_stage or model.is_last_stage):
            return None
        if not logits:
            return torch.empty(0, model.config.vocab_size, device=self.device)
        logits_out = torch.cat(logits) if len(logits) > 1 else logits[0]
        return logits_out if order is None else logits_out[to_device(order, self.device)]

    @staticmethod
    def _micro_batch_rows(token_ranges: list[range], logits_rows: list[int]
                          ) -> tuple[list[list[int]], list[int] | None]:
        """Each micro-batch's logits rows (indices into its own tokens, in `logits_rows`
        order), and for each row of `logits_rows` its place in their concatenation; None when
        that is already `logits_rows` order (rows ascending, as for sampling alone)."""
        starts = [tokens.start for tokens in token_ranges]
        part_rows: list[list[int]] = [[] for _ in token_ranges]
        places = []
        for row in logits_rows:
            part = bisect_right(starts, row) - 1
            places.append((part, len(part_rows[part])))
            part_rows[part].append(row - starts[part])
        offsets = list(accumulate((len(rows) for rows in part_rows), initial=0))
        order = [offsets[part] + index for part, index in places]
        return part_rows, None if order == list(range(len(order))) else order

    def _forward(self, batch: HostBatch, pending: PendingInputs,
                 previous_tokens: torch.Tensor | None, greedy_verify: bool = False
                 ) -> torch.Tensor | GreedyVerified:
        """Final hidden states of the step's tokens: a captured graph when one fits (not for
        the step that calculates the FP8 KV scales, nor one whose adapters adapt routed experts:
        the graphs were captured without them; nor with a connector's per-layer hooks). With
        `greedy_verify`, a graph that holds the greedy verification gives that instead."""
        lora = self.model.lora_context
        eager = self.model.kv_scales_pending or self.eager_layers or (
            batch.lora_slots is not None and lora is not None and lora.experts_adapted)
        for graphs in () if eager else self.graphs:
            size = graphs.prepare(batch)
            if size is not None:
                targets, sources = pending
                self._fill_pending(graphs.input_ids, (graphs.input_rows(targets), sources),
                                   previous_tokens)
                if self.host_store is not None:
                    self.host_store.finish_loads()  # a replay calls no layer hooks
                verified = graphs.replay_greedy(size, batch.num_requests,
                                                _widest_table(batch)) if greedy_verify else None
                if verified is not None:
                    return GreedyVerified(*verified)
                return graphs.replay(size, batch)
        context = get_pcp_group()
        if context.world_size > 1 and batch.num_tokens >= context.world_size:
            return self._forward_context_parallel(batch)
        input_ids, meta = batch.to_device(self.device, self.block_size)
        self._fill_pending(input_ids, pending, previous_tokens)
        piecewise = self.piecewise
        if piecewise is not None and not eager and batch.lora_slots is None \
                and self.model.context_writer is None and piecewise.fits(batch.num_tokens):
            if self.host_store is not None:
                self.host_store.finish_loads()  # the pieces call no layer hooks
            return piecewise.run(input_ids, meta)
        return self.model(input_ids, meta, self.kv_caches)

    def _forward_media(self, batch: HostBatch, pending: PendingInputs,
                       previous_tokens: torch.Tensor | None) -> torch.Tensor:
        """A step with media tokens, eagerly: the token embeddings with the encoder rows of
        the step's media slices written over theirs. With tensor or context parallelism
        every rank does the same (each encodes through its own cache, with the same
        encoders) and runs the whole step: the media rows need every token's embeddings."""
        input_ids, meta = batch.to_device(self.device, self.block_size)
        self._fill_pending(input_ids, pending, previous_tokens)
        embeds = self._scatter(self.model.model.embed_tokens(input_ids), batch)
        return self.model(input_ids, meta, self.kv_caches, inputs_embeds=embeds)

    def _media_embeds(self, batch: HostBatch) -> torch.Tensor:
        """The whole step's input embeddings with its media rows (a first pipeline stage,
        whose micro-batches take their rows of it: the step's items encode in one pass)."""
        return self._scatter(self.model.model.embed_tokens(
            to_device(batch.input_ids, self.device)), batch)

    def _scatter(self, embeds: torch.Tensor, batch: HostBatch) -> torch.Tensor:
        if self.encoders is None or self.encoder_cache is None:
            raise RuntimeError("a step with media reached a worker without encoders")
        return scatter_media(embeds, batch.media, self.encoders, self.encoder_cache)

    def _forward_context_parallel(self, batch: HostBatch) -> torch.Tensor:
        """Prefill context parallelism: this rank runs a contiguous slice of the step's tokens
        (equal shares, the first ranks one more), writes every token's K/V, and returns the
        whole step's hidden states. A step of fewer tokens than ranks runs whole on each."""
        context = get_pcp_group()
        self.context_parallel_steps += 1
        share, extra = divmod(batch.num_tokens, context.world_size)
        counts = [share + (rank < extra) for rank in range(context.world_size)]
        start = sum(counts[:context.rank_in_group])
        mine = batch.token_slice(start, start + counts[context.rank_in_group])
        input_ids, meta = mine.to_device(self.device, self.block_size)
        meta.context_parallel = ContextParallelMetadata(counts, {
            kind: to_device(slots, self.device) for kind, slots in batch.slots.items()})
        return self.model(input_ids, meta, self.kv_caches)

    def _fill_pending(self, input_ids: torch.Tensor, pending: PendingInputs,
                      previous_tokens: torch.Tensor | None) -> None:
        """Write tokens still on the device (the previous step's samples, or drafts) into
        this step's input ids."""
        targets, sources = pending
        if not targets:
            return
        if targets == sources == list(range(len(targets))):
            # Steady decoding: the same requests in the same order, no index tensors needed.
            input_ids[:len(targets)].copy_(previous_tokens[:len(targets)])
            return
        index = to_device([targets, sources], self.device)
        input_ids.index_copy_(0, index[0], previous_tokens.index_select(0, index[1]))


def _widest_table(batch: HostBatch | ChainedBatch) -> int:
    """The step's widest block table (blocks), which a greedy verify graph's drafting must hold."""
    return max(batch.table_width(kind) for kind in batch.kinds)

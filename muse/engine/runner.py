"""Turns a scheduled step into tensors, runs the model on them and samples the next tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from muse.engine.executor import Executor
from muse.engine.kv_cache import KVCacheManager
from muse.engine.metadata import HostBatch, build_host_batch, scheduled_entries
from muse.engine.request import Request, TokenLogprobs
from muse.engine.sampler import SamplingRow, prompt_logprobs, sample_on_device
from muse.engine.scheduler import ScheduledRequest
from muse.engine.transfer import HostCopy, to_device
from muse.engine.worker import GreedyVerified
from muse.multimodal.engine_inputs import MediaSlice, media_slices
from muse.speculative.chained_step import chained_batch
from muse.speculative.sampling import (VerifiedDrafts, drafts_verified_in_graph,
                                       sample_with_drafts, verified_in_graph,
                                       verified_without_drafts)
from muse.model.decoder import EngineModel


@dataclass
class LaunchedStep:
    """A step whose kernels are queued on the device. Its sampled tokens stay there, feeding
    the next step's inputs, until `token_values` reads them back (which waits for the step).
    """

    scheduled: list[ScheduledRequest]
    starts: list[int]  # each request's num_computed_tokens before the step
    sampled: list[Request]  # requests that sample a token this step, in row order
    tokens: torch.Tensor | None = None  # [len(sampled)] on the device
    tokens_on_host: HostCopy | None = None
    # Reads back each sampled request's logprobs (None where not asked for); waits like
    # token_values.
    read_logprobs: Callable[[], list[TokenLogprobs | None]] = list
    # request_id -> logprobs of the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Speculative decoding: each sampled request's drafts verified by this step, the position
    # of the token before them, and the verification (the tokens each request emits: the
    # accepted drafts and one more).
    drafts: list[list[int]] = field(default_factory=list)
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)  # q, None: one-hot
    draft_anchors: list[int] = field(default_factory=list)
    verified: VerifiedDrafts | None = None
    # Drafts left on the device: their tensor [requests, G] and each sampled request's row.
    device_drafts: tuple[torch.Tensor, list[int]] | None = None

    def token_values(self) -> list[int]:
        return self.tokens_on_host.tolist() if self.tokens_on_host is not None else []


@dataclass
class PreparedStep:
    """A step built on the host, not run yet: the batch, the rows whose logits it needs, and
    how to turn those logits into prompt logprobs and sampled tokens."""

    step: LaunchedStep
    batch: HostBatch | None = None
    logits_rows: list[int] = field(default_factory=list)
    pending: tuple[list[int], list[int]] = ([], [])
    pending_source: torch.Tensor | None = None  # the device tensor `pending` reads from
    delta: bytes | None = None  # the step as the other ranks get it (several ranks only)
    # (request id, prompt tokens predicted, first logits row, top logprobs wanted)
    prompt_spans: list[tuple[str, list[int], int, int]] = field(default_factory=list)
    sample_rows: list[SamplingRow] = field(default_factory=list)
    first_sample: int = 0  # logits rows from here on are the sampling requests', in order
    # Every request verifies its drafts greedily and wants nothing else: a verify graph may
    # return the verification itself (`GreedyVerified`) in place of the logits.
    greedy_verify: bool = False
    # No drafts, every request samples greedily: read back as a verify step of none
    # (`ModelRunner.chain_from_sampled_steps`).
    verify_without_drafts: bool = False


def allocate_kv_caches(model: EngineModel, num_blocks: dict[str, int], block_size: int,
                       dtype: torch.dtype, device: torch.device
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer this rank holds (its pipeline stage's), shaped
    [blocks of its kind, block_size, kv_heads, head_dim] (the K/V heads this rank holds)."""
    caches = []
    for kind in model.layer_types:
        shape = (num_blocks[kind], block_size, model.num_kv_heads, model.config.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device)))
    return caches


class ModelRunner:
    """The driver's side of a step: the batch from the scheduled requests, then sampling.

    The forward pass itself is the executor's: this process's worker alone, or every rank's.
    """

    def __init__(self, kv_cache: KVCacheManager, executor: Executor, device: torch.device
                 ) -> None:
        self.kv_cache = kv_cache
        self.executor = executor
        self.device = device
        self.block_size = kv_cache.block_size
        self.grammar_compiler = None  # set by the engine once a request is constrained
        self.rejection_sample_method = "token"  # how drafts are verified (speculation)
        # Where verify steps chain (`muse.speculative.chained_step`), a greedy step without
        # drafts (a prompt's last chunk) reads back as a verify step of none, so that the
        # first verify step can be made on the device behind it. Set by the engine.
        self.chain_from_sampled_steps = False
        # With several ranks, what each step sends them (they mirror the requests).
        self.step_encoder = None
        if executor.has_other_ranks:
            from muse.engine.step_message import StepEncoder

            self.step_encoder = StepEncoder(list(kv_cache.groups))

    def _host_batch(self, scheduled: list[ScheduledRequest]) -> HostBatch:
        kv_cache = self.kv_cache
        batch = build_host_batch(list(kv_cache.groups), self.block_size,
                                 kv_cache.sliding_window,
                                 scheduled_entries(scheduled, kv_cache.block_tables))
        if any(item.request.lora is not None for item in scheduled):
            batch.lora_slots = [item.request.lora.slot if item.request.lora else -1
                                for item in scheduled]
        return batch

    @staticmethod
    def _pending_inputs(scheduled: list[ScheduledRequest], previous: LaunchedStep | None
                        ) -> tuple[list[int], list[int]]:
        """(input index, row of `previous.tokens`) of every input token still on the device.

        A pending token is its request's last, and the one token a decode step feeds in."""
        if previous is None:
            return [], []
        rows = {request: row for row, request in enumerate(previous.sampled)}
        targets, sources = [], []
        offset = 0
        for item in scheduled:
            offset += item.num_new_tokens
            if item.request.num_pending_tokens:
                targets.append(offset - 1)
                sources.append(rows[item.request])
        return targets, sources

    def prepare(self, scheduled: list[ScheduledRequest], previous: LaunchedStep | None = None
                ) -> PreparedStep:
        """The step's batch and the rows whose logits it needs: prompt positions that predict
        a prompt token (prompt logprobs), then each sampling request's last position."""
        prepared = PreparedStep(LaunchedStep(
            scheduled, [s.request.num_computed_tokens for s in scheduled], []))
        sample_index: list[int] = []
        # Drafts on the device: (input index of the first, row in their tensor, count), and
        # each sampled request's row (0 for one without: its drafts count is 0).
        device_drafts: list[tuple[int, int, int]] = []
        draft_rows: list[int] = []
        draft_tensor = None
        media: list[MediaSlice] = []  # encoder rows this step scatters into its inputs
        offset = 0
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                # Positions start..end-1 predict the prompt tokens start+1..end.
                stop = min(end, request.num_prompt_tokens - 1)
                prepared.prompt_spans.append((request.request_id,
                                              request.prompt_token_ids[start + 1:stop + 1],
                                              len(prepared.logits_rows),
                                              request.params.prompt_logprobs))
                prepared.logits_rows.extend(range(offset, offset + stop - start))
            drafts = request.spec_token_ids
            if end == request.num_tokens + len(drafts):
                # The last known token's row and each draft's (all verified, one sample).
                last = offset + item.num_new_tokens - 1
                sample_index.extend(range(last - len(drafts), last + 1))
                prepared.step.drafts.append(list(drafts))
                prepared.step.draft_probs.append(request.spec_token_probs)
                prepared.step.draft_anchors.append(end - 1 - len(drafts))
                row = 0
                if request.spec_token_device is not None and drafts:
                    draft_tensor, row = request.spec_token_device
                    device_drafts.append((last - len(drafts) + 1, row, len(drafts)))
                draft_rows.append(row)
                prepared.step.sampled.append(request)
                prepared.sample_rows.append(SamplingRow(
                    request.params, request.prompt_token_ids, request.output_token_ids,
                    request.eos_token_ids, request.generator, request.grammar,
                    request.num_pending_tokens))
            if request.media:
                media += media_slices(request.media, start, end, offset)
            offset += item.num_new_tokens
        prepared.first_sample = len(prepared.logits_rows)
        prepared.logits_rows.extend(sample_index)
        prepared.batch = self._host_batch(scheduled)
        prepared.batch.media = media
        prepared.batch.kv_transfers = self.kv_cache.take_transfers()
        if self.step_encoder is not None:
            prepared.delta = self.step_encoder.encode_bytes(
                scheduled, self.kv_cache.block_tables, prepared.batch.kv_transfers)
        prepared.pending = self._pending_inputs(scheduled, previous)
        prepared.pending_source = previous.tokens if previous is not None else None
        prepared.greedy_verify = (
            any(prepared.step.drafts) and not prepared.prompt_spans
            and len(prepared.step.sampled) == len(scheduled)
            and all(item.num_new_tokens == len(drafts) + 1
                    for item, drafts in zip(scheduled, prepared.step.drafts))
            and verified_in_graph(prepared.sample_rows))
        prepared.verify_without_drafts = (
            self.chain_from_sampled_steps and bool(prepared.sample_rows)
            and not any(prepared.step.drafts) and not prepared.prompt_spans
            and len(prepared.step.sampled) == len(scheduled)
            and verified_in_graph(prepared.sample_rows))
        if device_drafts:
            # Speculation reads each step back before the next: nothing else is pending.
            width = draft_tensor.shape[1]
            prepared.pending = ([first + i for first, _, n in device_drafts for i in range(n)],
                                [row * width + i for _, row, n in device_drafts
                                 for i in range(n)])
            prepared.pending_source = draft_tensor.view(-1)
            prepared.step.device_drafts = (draft_tensor, draft_rows)
        return prepared

    @torch.inference_mode()
    def sample(self, prepared: PreparedStep, logits: torch.Tensor | GreedyVerified
               ) -> LaunchedStep:
        """Prompt logprobs and the sampled tokens of a step, from its logits rows (or the
        verification a verify graph made of it)."""
        step = prepared.step
        if isinstance(logits, GreedyVerified):
            step.verified = drafts_verified_in_graph(logits.rows, prepared.sample_rows,
                                                     step.drafts, logits.next_drafts)
            return step
        for request_id, targets, row, num_top in prepared.prompt_spans:
            step.prompt_logprobs[request_id] = prompt_logprobs(
                logits[row:row + len(targets)], to_device(targets, self.device), num_top)
        if any(step.drafts):
            step.verified = sample_with_drafts(
                logits[prepared.first_sample:], prepared.sample_rows, step.drafts,
                self.rejection_sample_method, step.draft_probs, step.device_drafts,
                self.grammar_compiler)
        elif prepared.sample_rows:
            step.tokens, step.read_logprobs = sample_on_device(
                logits[prepared.first_sample:], prepared.sample_rows, self.grammar_compiler)
            if prepared.verify_without_drafts:
                step.verified = verified_without_drafts(step.tokens, prepared.sample_rows)
            else:
                step.tokens_on_host = HostCopy(step.tokens)
        return step

    @torch.inference_mode()
    def launch_chained(self, previous: LaunchedStep, drafts: tuple[torch.Tensor, list[int]],
                       num_drafts: int) -> LaunchedStep:
        """Queue the verify step of `num_drafts` drafts a request that follows `previous` (a
        greedy verify step of the same requests, each with that many drafts or none, not read
        back yet), its inputs made on the device (`chained_step`): `drafts` are the next
        drafts (tensor, each request's row). Each request's blocks must already hold its
        longest case. The step's `starts` and `draft_anchors` are left for when `previous` is
        read back."""
        verified, requests = previous.verified, previous.sampled
        q = num_drafts + 1
        reach = len(previous.drafts[0]) + 1 + q  # past the anchor: `previous`'s, then this
        kinds = list(self.kv_cache.groups)
        tables: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
        first_blocks: dict[str, list[int]] = {kind: [] for kind in kinds}
        for request, anchor in zip(requests, previous.draft_anchors):
            held = self.kv_cache.block_tables(request)
            end_block = -(-(anchor + reach) // self.block_size)
            for kind in kinds:
                # The earliest the block can start (every draft rejected) to the latest end.
                first = self.kv_cache.window_start_block(kind, anchor + 1)
                tables[kind].append(held[kind][first:end_block])
                first_blocks[kind].append(first)
        tokens, rows = drafts
        if rows != list(range(len(rows))):  # else the rows are in the requests' order already
            tokens = tokens.index_select(0, to_device(rows, self.device))
        next_drafts = tokens[:len(rows), :num_drafts]
        batch = chained_batch(verified.accepted, verified.outputs, next_drafts,
                              list(previous.draft_anchors), tables, first_blocks,
                              self.block_size)
        batch.kv_transfers = self.kv_cache.take_transfers()
        step = LaunchedStep(
            [ScheduledRequest(request, q) for request in requests], [], list(requests),
            drafts=[[0] * num_drafts for _ in requests],
            draft_probs=[None] * len(requests), device_drafts=drafts)
        out = self.executor.execute_chained(batch)
        if isinstance(out, GreedyVerified):
            step.verified = drafts_verified_in_graph(out.rows, verified.rows, step.drafts,
                                                     out.next_drafts)
        else:
            step.verified = sample_with_drafts(out, verified.rows, step.drafts,
                                               device_drafts=drafts)
        return step

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], previous: LaunchedStep | None = None
               ) -> LaunchedStep:
        """Queue the step's forward pass and sampling on the device.

        Input tokens of `previous` not read back yet are taken from its device tensor."""
        prepared = self.prepare(scheduled, previous)
        logits = self.executor.execute(prepared.batch, prepared.logits_rows, prepared.pending,
                                       prepared.pending_source, prepared.delta,
                                       prepared.greedy_verify)
        return self.sample(prepared, logits)

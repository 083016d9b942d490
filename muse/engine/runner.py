"""Turns a scheduled step into tensors, runs the model on them and samples the next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from muse.config import TextConfig
from muse.engine.kv_cache import KVCacheManager
from muse.engine.cuda_graphs import DecodeGraphs
from muse.engine.metadata import HostBatch
from muse.engine.request import TokenLogprobs
from muse.engine.sampler import SamplingRow, prompt_logprobs, sample
from muse.engine.scheduler import ScheduledRequest
from muse.model.decoder import EngineModel


@dataclass
class StepResult:
    # request_id -> sampled token (only requests that reached the end of their known tokens)
    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs | None] = field(default_factory=dict)
    # request_id -> logprobs of the prompt tokens this step's chunk predicts
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def allocate_kv_caches(config: TextConfig, num_blocks: dict[str, int], block_size: int,
                       dtype: torch.dtype, device: torch.device
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, shaped [blocks of its kind, block_size, kv_heads, head_dim]."""
    caches = []
    for kind in config.layer_types:
        shape = (num_blocks[kind], block_size, config.num_key_value_heads, config.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device),
                       torch.zeros(shape, dtype=dtype, device=device)))
    return caches


class ModelRunner:
    def __init__(self, model: EngineModel, kv_cache: KVCacheManager,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.kv_caches = kv_caches
        self.device = device
        self.block_size = kv_cache.block_size
        self.decode_graphs = decode_graphs
        self.grammar_compiler = None  # set by the engine once a request is constrained

    def _host_batch(self, scheduled: list[ScheduledRequest]) -> HostBatch:
        block_size = self.block_size
        batch = HostBatch(kinds=list(self.kv_cache.pools),
                          max_query_len=max(s.num_new_tokens for s in scheduled))
        for index, item in enumerate(scheduled):
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            batch.input_ids.extend(request.token_ids(start, end))
            new_positions = range(start, end)
            batch.positions.extend(new_positions)
            batch.token_request.extend([index] * item.num_new_tokens)
            batch.query_start.append(batch.query_start[-1] + item.num_new_tokens)
            batch.seq_lens.append(end)
            for kind, table in self.kv_cache.block_tables(request).items():
                batch.slots[kind].extend(table[p // block_size] * block_size + p % block_size
                                         for p in new_positions)
                first = self.kv_cache.window_start_block(kind, start)
                batch.first_blocks[kind].append(first)
                batch.tables[kind].append(table[first:-(-end // block_size)])
        return batch

    def _forward(self, batch: HostBatch) -> torch.Tensor:
        """Final hidden states of the step's tokens: a captured graph when one fits."""
        if self.decode_graphs is not None:
            hidden = self.decode_graphs.run(batch)
            if hidden is not None:
                return hidden
        input_ids, meta = batch.to_device(self.device, self.block_size)
        return self.model(input_ids, meta, self.kv_caches)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest]) -> StepResult:
        hidden = self._forward(self._host_batch(scheduled))
        result = StepResult()
        sample_rows, sample_ids, sample_index = [], [], []
        offset = 0
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_new_tokens
            last = offset + item.num_new_tokens - 1
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                # Positions start..end-1 predict the prompt tokens start+1..end.
                stop = min(end, request.num_prompt_tokens - 1)
                logits = self.model.compute_logits(hidden[offset:offset + stop - start])
                targets = torch.tensor(request.prompt_token_ids[start + 1:stop + 1],
                                       device=self.device)
                result.prompt_logprobs[request.request_id] = prompt_logprobs(
                    logits, targets, request.params.prompt_logprobs)
            if end == request.num_tokens:
                sample_index.append(last)
                sample_ids.append(request.request_id)
                sample_rows.append(SamplingRow(request.params, request.prompt_token_ids,
                                               request.output_token_ids, request.eos_token_ids,
                                               request.generator, request.grammar))
            offset += item.num_new_tokens
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_index,
                                                                   device=self.device)])
            tokens, logprobs = sample(logits, sample_rows, self.grammar_compiler)
            result.tokens = dict(zip(sample_ids, tokens))
            result.logprobs = dict(zip(sample_ids, logprobs))
        return result

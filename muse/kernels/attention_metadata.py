"""What attention reads each step: where each token sits and where its K/V lives.

Defined here, below the model, so the kernels and the model read it without importing the
engine, which builds it (`muse.engine.metadata.HostBatch.to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KindMetadata:
    """Cache addressing for the layers of one attention kind (sliding or global).

    block_tables[r] lists request r's blocks starting at block `first_block[r]`; earlier blocks
    are not needed by this step's queries (sliding layers only keep their window).
    """

    slot_mapping: torch.Tensor  # [tokens] flat cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [requests, max_blocks] (null block 0 pads)
    first_block: torch.Tensor  # [requests]


@dataclass
class ContextParallelMetadata:
    """Prefill context parallelism: the step's tokens are cut into contiguous slices, one per
    rank of the context-parallel group, and this rank's `BatchMetadata` describes its slice.
    Each rank's K/V is gathered so that every rank writes the whole step's K/V (its cache
    holds every token, as the decode expects) before attending with its own queries."""

    num_tokens: list[int]  # tokens of each rank's slice, in group order
    slot_mappings: dict[str, torch.Tensor]  # kind -> [step tokens] slot of every token


@dataclass
class BatchMetadata:
    positions: torch.Tensor  # [tokens]
    token_request: torch.Tensor  # [tokens] index of the request each token belongs to
    query_start: torch.Tensor  # [requests + 1] offsets of each request's tokens
    seq_lens: torch.Tensor  # [requests] context length after this step
    max_query_len: int
    kinds: dict[str, KindMetadata]
    block_size: int
    # With data parallelism and expert parallelism: the tokens of each data-parallel rank's
    # batch this step (MoE layers gather every rank's tokens); None otherwise.
    dp_num_tokens: list[int] | None = None
    context_parallel: ContextParallelMetadata | None = None
    # [requests] each request's LoRA adapter slot (-1: none); None when no request uses one.
    lora_slots: torch.Tensor | None = None
    # Views of this step a kernel derives once and every layer reuses (the Triton backend's
    # one-decode-per-token form of short queries), keyed by the kind's metadata.
    per_token: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

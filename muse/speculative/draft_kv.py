"""The draft KV group: the drafter's projected context rows in pages beside the target's.

Each draft layer keeps keys and values of every context token in a pool shaped like the
target's global-attention pool, and block b of it holds the rows of the tokens whose target
K/V sits in block b there: a request's block table addresses both, so prefix-cache hits,
preemption and freeing need nothing of their own. The target's forward writes the rows of
every token it computes (`write`, inside its CUDA graphs too), drafts included: rows past a
request's last committed token are rewritten by the step that computes those positions again,
and the drafter reads only rows before its anchor, the last committed token.
"""

from __future__ import annotations

import torch

from muse.config import FULL
from muse.kernels.attention_metadata import BatchMetadata
from muse.speculative.drafter import DraftProposal, MuseDrafter
from muse.speculative.drafter_config import DrafterConfig


def draft_block_bytes(config: DrafterConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of the draft KV group (every draft layer's K and V)."""
    per_row = 2 * config.num_key_value_heads * config.head_dim * dtype.itemsize
    return config.num_hidden_layers * block_size * per_row


class DraftKV:
    """The drafter with its paged context rows: `write` from the target's forward, `propose`
    over a batch's block tables."""

    # The target's pool whose block tables the group shares: global layers keep every block.
    kind = FULL

    def __init__(self, drafter: MuseDrafter, num_blocks: int, block_size: int,
                 device: torch.device) -> None:
        config = drafter.config
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.drafter = drafter
        self.block_size = block_size
        self.pools = [(torch.zeros(shape, dtype=drafter.dtype, device=device),
                       torch.zeros(shape, dtype=drafter.dtype, device=device))
                      for _ in drafter.layers]

    @torch.no_grad()
    def write(self, features: torch.Tensor, meta: BatchMetadata) -> None:
        """Store the rows of a step's tokens: features [tokens, K*d] are the target's hidden
        states at the drafter's layers."""
        drafter = self.drafter
        context = drafter.fuse(features)
        slots = meta.kinds[self.kind].slot_mapping
        for layer, (k_pool, v_pool) in zip(drafter.layers, self.pools):
            k, v = layer.self_attn.keys_values(context, *drafter._rotary(meta.positions,
                                                                          layer.layer_type))
            k_pool.view(-1, *k_pool.shape[2:])[slots] = k
            v_pool.view(-1, *v_pool.shape[2:])[slots] = v

    @torch.no_grad()
    def propose(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                block_tables: torch.Tensor, temperature: float | torch.Tensor | None = 0.0,
                generator: torch.Generator | None = None) -> DraftProposal:
        """One block per request: anchor_tokens, anchor_positions [R] (each request's last
        committed token), block_tables [R, W] of the shared pool (null block 0 pads). The
        context is every row before the anchor; the gathered rows past it are masked.
        temperature None: greedy drafts without q."""
        requests, width = block_tables.shape[0], block_tables.shape[1] * self.block_size
        positions = torch.arange(width, device=block_tables.device).expand(requests, width)
        valid = positions < anchor_positions[:, None]
        gathered = [(k_pool[block_tables].flatten(1, 2), v_pool[block_tables].flatten(1, 2))
                    for k_pool, v_pool in self.pools]
        return self.drafter.draft_blocks(anchor_tokens, anchor_positions, positions, valid,
                                         lambda index, layer: gathered[index], temperature,
                                         generator)

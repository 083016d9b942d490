"""The draft KV group: the drafter's projected context rows in pages beside the target's.

Each draft layer keeps keys and values of every context token in a pool shaped like the
target's global-attention pool, and block b of it holds the rows of the tokens whose target
K/V sits in block b there: a request's block table addresses both, so prefix-cache hits,
preemption and freeing need nothing of their own. The target's forward writes the rows of
every token it computes (`write`, inside its CUDA graphs too), drafts included: rows past a
request's last committed token are rewritten by the step that computes those positions again,
and the drafter reads only rows before its anchor, the last committed token.

The two passes a CUDA graph holds on every verify step, storing the rows and drafting the next
block greedily, are a few hundred small kernels in eager PyTorch; where graphs are captured
`compile` hands both to torch.compile, which fuses them into a few dozen. The eager functions
stay the reference (`context_rows`, `greedy_drafts`) and the fallback if compiling fails;
the rows are scattered into the pools outside the compiled code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from muse.config import FULL
from muse.kernels.attention_metadata import BatchMetadata
from muse.speculative.drafter import DraftProposal, MuseDrafter
from muse.speculative.drafter_config import DrafterConfig

logger = logging.getLogger("muse")


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
        # What `write` and `draft_greedily` run: the eager functions, or their compiled twins.
        self._rows = self.context_rows
        self._draft = self.greedy_drafts

    def write(self, features: torch.Tensor, meta: BatchMetadata) -> None:
        """Store the rows of a step's tokens: features [tokens, K*d] are the target's hidden
        states at the drafter's layers."""
        slots = meta.kinds[self.kind].slot_mapping
        with torch.no_grad():
            # The scatter stays outside the compiled code: there a write into a view of the
            # pool is functionalized into a copy of the whole pool.
            for (k, v), (k_pool, v_pool) in zip(self._rows(features, meta.positions),
                                                self.pools):
                k_pool.view(-1, *k_pool.shape[2:])[slots] = k
                v_pool.view(-1, *v_pool.shape[2:])[slots] = v

    def draft_greedily(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                       block_tables: torch.Tensor) -> torch.Tensor:
        """`greedy_drafts`, compiled where `compile` was called."""
        with torch.no_grad():
            return self._draft(anchor_tokens, anchor_positions, block_tables)

    def compile(self, backend: str | Callable = "inductor") -> bool:
        """Run the rows `write` stores and `draft_greedily` through torch.compile (`backend`),
        shapes dynamic so that every batch bucket and table width shares one compilation
        (size 1 gets its own). Each compiles on its first call, under inference mode as the
        engine runs it: make that call outside a CUDA graph capture (the graphs' warm-up runs
        do). Returns False, keeping the eager functions, where this torch cannot compile them
        (tried here on a three-request draft). Not `fullgraph`: past dynamo's recompile limit
        a call runs eagerly instead of failing (a test checks each compiles as one graph)."""
        rows = torch.compile(self.context_rows, backend=backend, dynamic=True)
        draft = torch.compile(self.greedy_drafts, backend=backend, dynamic=True)
        config, device = self.drafter.config, self.pools[0][0].device
        try:
            with torch.inference_mode():
                # Drafts from empty contexts (block 0 is the null block); the eager run first
                # fills the drafter's rotary cache.
                zero = torch.zeros(3, dtype=torch.long, device=device)
                features = torch.zeros(3, config.num_target_features * config.hidden_size,
                                       dtype=self.drafter.dtype, device=device)
                self.greedy_drafts(zero, zero, zero[:, None])
                draft(zero, zero, zero[:, None])
                rows(features, zero)
        except Exception as error:  # an unsupported platform or backend: stay eager
            logger.warning("the drafter stays eager: torch.compile failed (%s)", error)
            return False
        self._rows, self._draft = rows, draft
        return True

    def context_rows(self, features: torch.Tensor, positions: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each draft layer's K and V rows [tokens, kv_heads, head_dim] of tokens at
        `positions` [tokens], from the target's hidden states `features` [tokens, K*d].
        (Undecorated, as `greedy_drafts`: each compiles as its own code, called under
        `no_grad`.)"""
        drafter = self.drafter
        context = drafter.fuse(features)
        return [layer.self_attn.keys_values(context, *drafter._rotary(positions,
                                                                      layer.layer_type))
                for layer in drafter.layers]

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

    def greedy_drafts(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                      block_tables: torch.Tensor) -> torch.Tensor:
        """The tokens [R, G] of `propose` with every draft the argmax."""
        return self.propose(anchor_tokens, anchor_positions, block_tables, None).tokens

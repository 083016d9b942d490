"""The token embedding and the LM head, their vocabulary rows split over TP.

The vocabulary is padded so every rank holds the same number of rows (a multiple of
`padding_size`, which also keeps the LM head's GEMM on friendly shapes): rank r holds rows
[r * V_rank, (r + 1) * V_rank) of the padded table. Padding rows are zero and never looked
up; their logits are cut off after the gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from muse.distributed.parallel_state import get_tp_group
from muse.layers.lazy_slice import LazySlice, copy_into
from muse.layers.quantization import set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class VocabParallelEmbedding(nn.Module):
    """Embedding table with vocabulary rows split over TP.

    Each rank looks up the ids in its range (others read row 0 and are zeroed), and the
    all-reduce over TP fills every token from the one rank that holds it.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank_in_group
        self.tp_size = self.tp_group.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = round_up(-(-num_embeddings // self.tp_size),
                                                     padding_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        # The real (unpadded) rows of this rank end here; the last ranks may hold only padding.
        self.vocab_end_index = max(self.vocab_start_index, min(
            self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings))
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim,
                        dtype=params_dtype or torch.get_default_dtype()), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader, output_dim=0)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: int | str | None = None) -> None:
        """Load this rank's rows of the [num_embeddings, dim] checkpoint table; zero padding."""
        name = f"{self.prefix}.weight" if self.prefix else f"{type(self).__name__}.weight"
        if shard_id is not None:
            raise ValueError(f"{name} is not fused: shard_id must be None, got {shard_id!r}")
        source = LazySlice.of(loaded)
        if source.shape[0] != self.num_embeddings:
            raise ValueError(f"{name}: the checkpoint has {source.shape[0]} rows where the "
                             f"vocabulary has {self.num_embeddings}")
        rows = self.vocab_end_index - self.vocab_start_index
        if rows:
            copy_into(param.data[:rows], source.narrow(0, self.vocab_start_index, rows), name)
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        # Static shapes and no host reads: capturable in a CUDA graph.
        in_range = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = torch.where(in_range, input_ids - self.vocab_start_index, 0)
        out = F.embedding(local_ids, self.weight)
        out = out.masked_fill(~in_range.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (rows {self.vocab_start_index}.."
                f"{self.vocab_end_index} of {self.num_embeddings_padded} padded), "
                f"dim={self.embedding_dim}, tp={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """hidden [..., dim] -> logits [..., num_embeddings], vocabulary rows split over TP.

    Each rank computes its rows' logits; the all-gather over TP concatenates them in rank
    order, which is vocabulary order, and the padding columns are cut off.
    """

    def tie_weights(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """Share the embedding's table (config `tie_word_embeddings`); load it once."""
        if (embedding.num_embeddings_per_partition, embedding.embedding_dim,
                embedding.vocab_start_index) != (self.num_embeddings_per_partition,
                                                 self.embedding_dim, self.vocab_start_index):
            raise ValueError("tied embedding and LM head must have the same vocabulary, width "
                             "and padding")
        self.weight = embedding.weight
        return self

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = self.tp_group.all_gather(logits, dim=-1)
        if self.num_embeddings_padded != self.num_embeddings:
            logits = logits[..., :self.num_embeddings]
        return logits

"""Parallel sizes and the rank layout.

Ranks are laid out with TP fastest, as vLLM does, so that the ranks of a TP group (the most
talkative one) are neighbours, which on one machine means GPUs on the same NVLink domain:

    rank = ((dp * PP + pp) * PCP + pcp) * TP + tp
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SIZE_FIELDS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
               "prefill_context_parallel_size")


@dataclass(frozen=True)
class RankCoordinates:
    """Where one global rank sits on each parallel axis."""

    dp: int
    pp: int
    pcp: int
    tp: int


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    # Experts are sharded over every rank of a pipeline stage (dp x pcp x tp of them) instead
    # of being split by TP like the dense layers.
    enable_expert_parallel: bool = False

    @property
    def world_size(self) -> int:
        return (self.data_parallel_size * self.pipeline_parallel_size
                * self.prefill_context_parallel_size * self.tensor_parallel_size)

    @property
    def expert_parallel_size(self) -> int:
        if not self.enable_expert_parallel:
            return 1
        return (self.data_parallel_size * self.prefill_context_parallel_size
                * self.tensor_parallel_size)

    def validate(self) -> None:
        for name in SIZE_FIELDS:
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError("`enable_expert_parallel` must be True or False, "
                             f"got {self.enable_expert_parallel!r}")

    def coordinates(self, rank: int) -> RankCoordinates:
        self._check_rank(rank)
        tp = rank % self.tensor_parallel_size
        rest = rank // self.tensor_parallel_size
        pcp = rest % self.prefill_context_parallel_size
        rest //= self.prefill_context_parallel_size
        pp = rest % self.pipeline_parallel_size
        dp = rest // self.pipeline_parallel_size
        return RankCoordinates(dp=dp, pp=pp, pcp=pcp, tp=tp)

    def rank_of(self, coordinates: RankCoordinates) -> int:
        """The global rank at these coordinates (the inverse of `coordinates`)."""
        c = coordinates
        sizes = {"dp": self.data_parallel_size, "pp": self.pipeline_parallel_size,
                 "pcp": self.prefill_context_parallel_size, "tp": self.tensor_parallel_size}
        for axis, size in sizes.items():
            index = getattr(c, axis)
            if not (isinstance(index, int) and 0 <= index < size):
                raise ValueError(f"coordinate `{axis}` must be in [0, {size}), got {index!r}")
        return (((c.dp * self.pipeline_parallel_size + c.pp)
                 * self.prefill_context_parallel_size + c.pcp)
                * self.tensor_parallel_size + c.tp)

    def _check_rank(self, rank: int) -> None:
        if not (isinstance(rank, int) and not isinstance(rank, bool)
                and 0 <= rank < self.world_size):
            raise ValueError(f"`rank` must be an integer in [0, {self.world_size}) "
                             f"(world_size), got {rank!r}")


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0

"""Which global ranks form each group: pure functions of a `ParallelConfig`.

A group of one kind holds the ranks that differ only on that kind's axes; EP spans every
axis but the pipeline stage, since a stage's experts are spread over all of its ranks. Groups
are listed in increasing order of their first rank, and ranks inside a group ascend, so a
rank's place in the group follows the global layout (for EP: dp, then pcp, then tp).
"""

from __future__ import annotations

import itertools

from muse.distributed.config import ParallelConfig, RankCoordinates

AXES = ("dp", "pp", "pcp", "tp")  # slowest to fastest, as in the rank layout
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "world": AXES,
    "tp": ("tp",),
    "pp": ("pp",),
    "pcp": ("pcp",),
    "dp": ("dp",),
    "ep": ("dp", "pcp", "tp"),
}
# The order every rank creates groups in; torch requires the same order on all ranks.
GROUP_KINDS = tuple(GROUP_AXES)


def axis_sizes(config: ParallelConfig) -> dict[str, int]:
    return {"dp": config.data_parallel_size, "pp": config.pipeline_parallel_size,
            "pcp": config.prefill_context_parallel_size, "tp": config.tensor_parallel_size}


def group_ranks(config: ParallelConfig, kind: str) -> list[list[int]]:
    """Every group of `kind` (one of `GROUP_KINDS`), each as a sorted list of global ranks.

    Without expert parallelism each EP group is a single rank.
    """
    if kind not in GROUP_AXES:
        raise ValueError(f"group kind must be one of {GROUP_KINDS}, got {kind!r}")
    if kind == "ep" and not config.enable_expert_parallel:
        return [[rank] for rank in range(config.world_size)]
    sizes = axis_sizes(config)
    varying = GROUP_AXES[kind]
    fixed = [axis for axis in AXES if axis not in varying]
    groups = []
    for fixed_index in itertools.product(*(range(sizes[axis]) for axis in fixed)):
        ranks = []
        for varying_index in itertools.product(*(range(sizes[axis]) for axis in varying)):
            index = dict(zip(fixed, fixed_index)) | dict(zip(varying, varying_index))
            ranks.append(config.rank_of(RankCoordinates(**index)))
        groups.append(sorted(ranks))
    return sorted(groups)


def group_of(config: ParallelConfig, kind: str, rank: int) -> list[int]:
    """The ranks of the `kind` group that holds global `rank`."""
    config.coordinates(rank)  # validates the rank
    return next(ranks for ranks in group_ranks(config, kind) if rank in ranks)

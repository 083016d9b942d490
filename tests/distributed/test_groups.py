"""Rank layout, group membership and config validation: pure functions, no processes."""

from __future__ import annotations

import itertools

import pytest

from muse.distributed.config import ParallelConfig, RankCoordinates
from muse.distributed.layout import GROUP_AXES, GROUP_KINDS, group_of, group_ranks


def _all_groups(config: ParallelConfig) -> dict[str, list[list[int]]]:
    return {kind: group_ranks(config, kind) for kind in GROUP_KINDS}


def test_tp2_pp2_layout_puts_tp_fastest() -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert config.world_size == 4 and config.expert_parallel_size == 1
    assert [config.coordinates(rank) for rank in range(4)] == [
        RankCoordinates(dp=0, pp=0, pcp=0, tp=0), RankCoordinates(dp=0, pp=0, pcp=0, tp=1),
        RankCoordinates(dp=0, pp=1, pcp=0, tp=0), RankCoordinates(dp=0, pp=1, pcp=0, tp=1)]
    assert _all_groups(config) == {
        "world": [[0, 1, 2, 3]],
        "tp": [[0, 1], [2, 3]],
        "pp": [[0, 2], [1, 3]],
        "pcp": [[0], [1], [2], [3]],
        "dp": [[0], [1], [2], [3]],
        "ep": [[0], [1], [2], [3]],
    }


def test_dp2_tp2_with_expert_parallel_spans_the_stage() -> None:
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                            enable_expert_parallel=True)
    assert config.world_size == 4 and config.expert_parallel_size == 4
    assert config.coordinates(2) == RankCoordinates(dp=1, pp=0, pcp=0, tp=0)
    groups = _all_groups(config)
    assert groups["tp"] == [[0, 1], [2, 3]]
    assert groups["dp"] == [[0, 2], [1, 3]]
    assert groups["ep"] == [[0, 1, 2, 3]]
    assert groups["pp"] == groups["pcp"] == [[0], [1], [2], [3]]


def test_pcp2_sits_between_pipeline_and_tensor() -> None:
    config = ParallelConfig(tensor_parallel_size=2, prefill_context_parallel_size=2,
                            pipeline_parallel_size=2)
    assert config.coordinates(5) == RankCoordinates(dp=0, pp=1, pcp=0, tp=1)
    assert config.coordinates(6) == RankCoordinates(dp=0, pp=1, pcp=1, tp=0)
    groups = _all_groups(config)
    assert groups["pcp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_expert_groups_are_pipeline_stages_across_dp_pcp_and_tp() -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2,
                            data_parallel_size=2, prefill_context_parallel_size=2,
                            enable_expert_parallel=True)
    assert config.world_size == 16 and config.expert_parallel_size == 8
    assert group_ranks(config, "ep") == [[0, 1, 2, 3, 8, 9, 10, 11],
                                         [4, 5, 6, 7, 12, 13, 14, 15]]
    assert group_ranks(config, "dp") == [[r, r + 8] for r in range(8)]
    assert group_of(config, "pp", 9) == [9, 13]
    assert group_of(config, "tp", 9) == [8, 9]
    assert group_of(config, "pcp", 9) == [9, 11]


@pytest.mark.parametrize("sizes", list(itertools.product((1, 2, 3), repeat=4)))
def test_every_kind_partitions_the_world_by_its_axes(sizes: tuple[int, ...]) -> None:
    dp, pp, pcp, tp = sizes
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                            data_parallel_size=dp, prefill_context_parallel_size=pcp,
                            enable_expert_parallel=True)
    ranks = range(config.world_size)
    assert [((c.dp * pp + c.pp) * pcp + c.pcp) * tp + c.tp
            for c in map(config.coordinates, ranks)] == list(ranks)
    for kind, groups in _all_groups(config).items():
        assert sorted(itertools.chain(*groups)) == list(ranks), kind
        size = {"world": config.world_size, "tp": tp, "pp": pp, "pcp": pcp, "dp": dp,
                "ep": config.expert_parallel_size}[kind]
        for group in groups:
            assert len(group) == size, kind
            # Members agree on every axis outside the kind's own.
            fixed = [axis for axis in ("dp", "pp", "pcp", "tp") if axis not in GROUP_AXES[kind]]
            coordinates = [config.coordinates(rank) for rank in group]
            assert len({tuple(getattr(c, axis) for axis in fixed) for c in coordinates}) == 1


def test_expert_parallel_off_gives_single_rank_groups() -> None:
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)
    assert config.expert_parallel_size == 1
    assert group_ranks(config, "ep") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("field", ["tensor_parallel_size", "pipeline_parallel_size",
                                   "data_parallel_size", "prefill_context_parallel_size"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2", None])
def test_validate_names_the_bad_size(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"`{field}` must be a positive integer"):
        ParallelConfig(**{field: value}).validate()


def test_validate_checks_expert_parallel_flag() -> None:
    with pytest.raises(ValueError, match="`enable_expert_parallel` must be True or False"):
        ParallelConfig(enable_expert_parallel="yes").validate()
    ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True).validate()


def test_coordinates_refuses_ranks_outside_the_world() -> None:
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    for rank in (-1, 4, True):
        with pytest.raises(ValueError, match=r"`rank` must be an integer in \[0, 4\)"):
            config.coordinates(rank)
    with pytest.raises(ValueError, match="group kind must be one of"):
        group_ranks(config, "sp")

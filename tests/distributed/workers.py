"""Functions run inside spawned ranks by the collective tests (module level, so they pickle).

Every rank draws every member's inputs from seeds, so it can compute each collective's
expected result alone, the single-process way, and return both for the test to compare.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from muse.distributed import parallel_state as ps
from muse.distributed.group import GroupCoordinator
from muse.distributed.layout import GROUP_KINDS, group_of


@dataclass
class Check:
    name: str
    actual: Any
    expected: Any
    exact: bool = True  # sums may differ in rounding with the order of addition


def collective_checks(rank: int, seed: int) -> list[Check]:
    """Membership of every group, then every collective of every group, as built (the
    backend's own ops) and with every fallback; pipeline send / recv where there are stages."""
    torch.set_num_threads(1)
    config = ps.get_parallel_config()
    checks = [Check("is_initialized", ps.is_initialized(), True),
              Check("tp rank", ps.get_tensor_model_parallel_rank(),
                    config.coordinates(rank).tp),
              Check("tp size", ps.get_tensor_model_parallel_world_size(),
                    config.tensor_parallel_size)]
    groups = {"world": ps.get_world_group(), "tp": ps.get_tp_group(), "pp": ps.get_pp_group(),
              "dp": ps.get_dp_group(), "ep": ps.get_ep_group(), "pcp": ps.get_pcp_group()}
    assert set(groups) == set(GROUP_KINDS)
    for kind_index, (kind, group) in enumerate(groups.items()):
        checks += membership_checks(kind, group, config, rank)
        fallback = GroupCoordinator(group.ranks, rank, group.device_group, group.cpu_group,
                                    group.backend, group.device, native_ops=frozenset())
        for mode_index, (mode, variant) in enumerate({"native": group,
                                                      "fallback": fallback}.items()):
            # The same seed on every rank of the group, a different one per group and mode.
            group_seed = seed + 100 * (2 * kind_index + mode_index)
            checks += [_prefixed(f"{kind}/{mode} ", c) for c in group_checks(variant, group_seed)]
    if groups["pp"].world_size > 1:
        checks += pipeline_checks(groups["pp"], seed)
    return checks


def membership_checks(kind: str, group: GroupCoordinator, config: Any, rank: int) -> list[Check]:
    expected = group_of(config, kind, rank)
    # Gathering the global ranks over the group proves who is really connected to whom.
    connected = group.all_gather(torch.tensor([rank], device=group.device), dim=0)
    return [Check(f"{kind} ranks", group.ranks, expected),
            Check(f"{kind} rank_in_group", group.rank_in_group, expected.index(rank)),
            Check(f"{kind} connected ranks", connected.cpu().tolist(), expected)]


def group_checks(group: GroupCoordinator, seed: int) -> list[Check]:
    n, me, members = group.world_size, group.rank_in_group, group.ranks
    dev = group.device

    def inputs(offset: int, *shape: int) -> list[torch.Tensor]:
        return [_random(seed + offset, member, *shape) for member in members]

    def run(x: torch.Tensor) -> torch.Tensor:
        return x.to(dev)

    checks = []
    xs = inputs(1, 3, 5)
    checks.append(Check("all_reduce", group.all_reduce(run(xs[me].clone())).cpu(),
                        torch.stack(xs).sum(0), exact=False))
    xs = inputs(2, 5, 3)
    checks.append(Check("all_reduce non-contiguous", group.all_reduce(run(xs[me]).t()).cpu(),
                        torch.stack(xs).sum(0).t(), exact=False))
    for dim in (0, -1, 1):
        xs = inputs(3, 2, 3, 4)
        checks.append(Check(f"all_gather dim={dim}", group.all_gather(run(xs[me]), dim).cpu(),
                            torch.cat(xs, dim)))
    for dim in (0, 1, -1):
        xs = inputs(4, 2 * n, 3 * n)
        mine = run(xs[me])
        before = mine.clone()
        checks.append(Check(f"reduce_scatter dim={dim}", group.reduce_scatter(mine, dim).cpu(),
                            sum(xs).chunk(n, dim)[me], exact=False))
        checks.append(Check(f"reduce_scatter dim={dim} leaves x", mine.cpu(), before.cpu()))
    # Uneven rows, one rank empty when there are several.
    counts = [(r * 2 + seed) % 4 if n > 1 else 3 for r in range(n)]
    xs = [_random(seed + 9, member, counts[r], 3) for r, member in enumerate(members)]
    checks.append(Check("all_gather_rows", group.all_gather_rows(run(xs[me]), counts).cpu(),
                        torch.cat(xs)))
    checks += _all_to_all_checks(group, seed, run)
    for src in range(n):
        xs = inputs(6 + src, 4, 2)
        checks.append(Check(f"broadcast src={src}", group.broadcast(run(xs[me]), src).cpu(),
                            xs[src]))
        sent = {"from": members[src], "ids": list(range(src + 3))}
        checks.append(Check(f"broadcast_object src={src}",
                            group.broadcast_object(sent if me == src else None, src), sent))
    group.barrier()
    return checks


def _all_to_all_checks(group: GroupCoordinator, seed: int, run: Any) -> list[Check]:
    n, me, members = group.world_size, group.rank_in_group, group.ranks
    # Rows sender r sends to receiver j: uneven, with empty chunks.
    splits = [[(r + 2 * j + seed) % 3 for j in range(n)] for r in range(n)]
    xs = [_random(seed + 5, members[r], sum(splits[r]), 4) for r in range(n)]
    expected = torch.cat([xs[r].split(splits[r])[me] for r in range(n)])
    received = [splits[r][me] for r in range(n)]
    checks = [
        Check("all_to_all uneven",
              group.all_to_all(run(xs[me]), splits[me], received).cpu(), expected),
        Check("all_to_all uneven, sizes exchanged",
              group.all_to_all(run(xs[me]), splits[me]).cpu(), expected),
        Check("all_to_all nothing to send",
              group.all_to_all(run(xs[me][:0]), [0] * n).cpu(), xs[me][:0])]
    xs = [_random(seed + 5, member, 2 * n, 3) for member in members]
    checks.append(Check("all_to_all even", group.all_to_all(run(xs[me])).cpu(),
                        torch.cat([x.chunk(n)[me] for x in xs])))
    return checks


def pipeline_checks(pp: GroupCoordinator, seed: int) -> list[Check]:
    """Activations down the stages and token ids back up, as a pipeline step does."""
    checks = []
    activations = [_random(seed + 7, member, 3, 8) for member in pp.ranks]
    if not pp.is_first_rank:
        got = pp.recv((3, 8), torch.float32, src=pp.prev_rank)
        checks.append(Check("pp recv from previous stage", got.cpu(),
                            activations[pp.prev_rank]))
    if not pp.is_last_rank:
        pp.send(activations[pp.rank_in_group].to(pp.device), dst=pp.next_rank)
    tokens = [torch.arange(5) * 10 + member for member in pp.ranks]
    if not pp.is_last_rank:
        got = pp.recv((5,), torch.int64, src=pp.next_rank)
        checks.append(Check("pp recv from next stage", got.cpu(), tokens[pp.next_rank]))
    if not pp.is_first_rank:
        pp.send(tokens[pp.rank_in_group].to(pp.device), dst=pp.prev_rank)
    return checks


def fail_on_rank_one(rank: int) -> None:
    """Rank 1 raises while rank 0 waits for it in a barrier that never completes."""
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    ps.get_world_group().barrier()


def sleep_then_return(rank: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def _random(seed: int, rank: int, *shape: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    return torch.randn(*shape, generator=generator)


def _prefixed(prefix: str, check: Check) -> Check:
    return Check(prefix + check.name, check.actual, check.expected, check.exact)

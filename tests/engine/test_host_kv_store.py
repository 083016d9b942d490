"""`HostKVStore` moves blocks between the GPU pool and host slots in the order a step's
`KVTransfers` gives, also when the compute stream overwrites a saved block right after the
save (write-back) and a load reads a slot saved in the same step. On a GPU the copies run on
their own stream into page-locked slots; on a CPU in place. Both give the same bytes."""

from __future__ import annotations

import pytest
import torch

from muse.engine.host_kv_store import HostKVStore, _runs, layer_groups
from muse.engine.kv_transfers import KVTransfers

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LAYERS = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
BLOCKS, BLOCK_SIZE, HEADS, DIM = 24, 4, 2, 8


def caches(device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [tuple(torch.randn((BLOCKS, BLOCK_SIZE, HEADS, DIM), generator=generator,
                              dtype=torch.float32).to(device) for _ in range(2))
            for _ in LAYERS]


def block(kv: list[tuple[torch.Tensor, torch.Tensor]], kind: str, index: int) -> torch.Tensor:
    return torch.stack([torch.stack((k[index], v[index])) for (k, v), t in zip(kv, LAYERS)
                        if t == kind]).cpu()


def busy(device: str) -> None:
    """Keep the compute stream busy for a while (on a GPU), so copies on other streams that
    do not wait for it would run ahead of its work."""
    if device == "cuda":
        torch.cuda._sleep(200_000_000)


def test_runs_of_consecutive_slots() -> None:
    assert _runs([]) == []
    assert _runs([3, 4, 5, 9, 10, 12]) == [(0, 3, 3), (3, 9, 2), (5, 12, 1)]
    assert _runs([7, 7]) == [(0, 7, 1), (1, 7, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_saved_blocks_come_back_after_their_blocks_are_overwritten(device, tmp_path) -> None:
    kv = caches(device)
    store = HostKVStore(LAYERS, kv, {"sliding_attention": 16, "full_attention": 16},
                        disk_root=tmp_path, shard="pp0-tp0")
    (tmp_path / "full_attention").mkdir()
    kinds = ("sliding_attention", "full_attention")
    before = {(kind, b): block(kv, kind, b) for kind in kinds for b in range(BLOCKS)}
    # Blocks 0-5 to slots out of order (runs and single slots); then the "forward pass"
    # overwrites them at once, as write-back lets it.
    slots = [9, 2, 3, 4, 15, 10]
    busy(device)  # the gather then runs late: the save's copies must wait for it
    store.apply(KVTransfers(saves=[(kind, b, s) for kind in kinds
                                   for b, s in enumerate(slots)]))
    for k, v in kv:
        k[:6].fill_(-1.0)
        v[:6].fill_(-1.0)
    # The next step saves block 6 into slot 0 and loads slots 0, 2, 15 and 10 (one saved in
    # this very step) into blocks 20-23; a slot goes to disk, and comes back from it.
    busy(device)
    store.apply(KVTransfers(saves=[(kind, 6, 0) for kind in kinds],
                            loads=[(kind, s, 20 + i) for kind in kinds
                                   for i, s in enumerate([0, 2, 15, 10])]))
    store.finish_loads()
    store.apply(KVTransfers(disk_saves=[("full_attention", 9, "ab" * 32)]))
    store.apply(KVTransfers(disk_loads=[("full_attention", "ab" * 32, 19)]))
    if device == "cuda":
        torch.cuda.synchronize()
    for kind in kinds:
        for i, source in enumerate([6, 1, 4, 5]):
            assert torch.equal(block(kv, kind, 20 + i), before[(kind, source)]), (kind, i)
    assert torch.equal(block(kv, "full_attention", 19), before[("full_attention", 0)])
    assert torch.equal(block(kv, "sliding_attention", 19),
                       before[("sliding_attention", 19)])  # untouched


def test_layer_groups() -> None:
    types = ["s", "f", "s", "s", "f", "s", "s", "f"]
    assert layer_groups(types, "f", 4) == [(0, [1]), (2, [4]), (3, [7])]
    assert layer_groups(types, "s", 4) == [(0, [0]), (1, [2, 3]), (2, [5]), (3, [6])]
    assert layer_groups(types, "f", 1) == [(0, [1, 4, 7])]
    assert layer_groups(["f", "f"], "f", 4) == [(0, [0]), (2, [1])]


@pytest.mark.parametrize("device", DEVICES)
def test_loads_land_a_layer_group_at_a_time_as_the_forward_pass_reaches_it(device) -> None:
    kv = caches(device)
    store = HostKVStore(LAYERS, kv, {"sliding_attention": 4, "full_attention": 4},
                        load_groups=2)  # layers 0-1, then 2-3
    assert store.group_starts == {0: 0, 1: 2}
    kinds = ("sliding_attention", "full_attention")
    saved = {kind: block(kv, kind, 3) for kind in kinds}
    store.apply(KVTransfers(saves=[(kind, 3, 1) for kind in kinds]))
    busy(device)
    store.apply(KVTransfers(loads=[(kind, 1, 7) for kind in kinds]))
    untouched = block(kv, "sliding_attention", 7)
    assert torch.equal(block(kv, "full_attention", 7), block(caches(device), "full_attention", 7))
    store.before_layer(0)  # the first group: layers 0 and 1
    store.before_layer(1)
    assert torch.equal(block(kv, "sliding_attention", 7)[0], saved["sliding_attention"][0])
    assert torch.equal(block(kv, "sliding_attention", 7)[1], untouched[1])  # layer 2: later
    assert torch.equal(block(kv, "full_attention", 7)[0], saved["full_attention"][0])
    store.before_layer(2)
    assert not store.pending
    for kind in kinds:
        assert torch.equal(block(kv, kind, 7), saved[kind])

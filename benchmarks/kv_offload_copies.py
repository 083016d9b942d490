"""What a step's host-tier copies cost (`muse.engine.host_kv_store.HostKVStore.apply`), on a
model's KV shape: for saves and for loads of `--blocks` blocks of every kind,

- host_ms: the host's time in `apply` (launching gathers, copies and scatters);
- compute_ms: the GPU time the copies add to the compute stream (the gather before a
  save, the wait for a load and its scatter), measured with events around `apply`;
- landed_ms: from the call until the copies have landed (saves: in host memory).

The KV caches are the preset's layers and heads, `--gpu-blocks` blocks of each kind, with
`--host-blocks` host slots per kind. Median of `--repeats` after a warm-up.

    python benchmarks/kv_offload_copies.py --preset muse-spark-15b-a2b --out results/kv-copies.json
    python benchmarks/kv_offload_copies.py --preset muse-spark-tiny --device cpu   # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.options import resolve_device  # noqa: E402
from benchmarks.report import environment, write_json  # noqa: E402
from muse.engine.host_kv_store import HostKVStore  # noqa: E402
from muse.engine.kv_transfers import KVTransfers  # noqa: E402
from muse.presets import get_preset  # noqa: E402


def _kv_caches(layer_types: list[str], blocks: int, block_size: int, heads: int, dim: int,
               dtype: torch.dtype, device: torch.device
               ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (blocks, block_size, heads, dim)
    return [(torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device)
             .to(dtype)) for _ in layer_types]


def _time(store: HostKVStore, transfers: KVTransfers, device: torch.device,
          repeats: int) -> dict[str, float]:
    host, compute, landed = [], [], []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        store.apply(transfers)
        store.finish_loads()
        host.append(time.perf_counter() - began)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            compute.append(start.elapsed_time(end) / 1e3)
            torch.cuda.synchronize()
        landed.append(time.perf_counter() - began)
    median = lambda values: round(1e3 * statistics.median(values[1:]), 3)  # noqa: E731
    return {"host_ms": median(host), "compute_ms": median(compute) if compute else None,
            "landed_ms": median(landed)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="muse-spark-15b-a2b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", default="8,64,512", help="blocks per kind per step")
    parser.add_argument("--gpu-blocks", type=int, default=2048)
    parser.add_argument("--host-blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    config = get_preset(args.preset).text_config
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    caches = _kv_caches(config.layer_types, args.gpu_blocks, args.block_size,
                        config.num_key_value_heads, config.head_dim, dtype, device)
    kinds = list(dict.fromkeys(config.layer_types))
    store = HostKVStore(config.layer_types, caches, {kind: args.host_blocks for kind in kinds})
    rows = []
    for count in (int(n) for n in args.blocks.split(",")):
        blocks = list(range(0, 2 * count, 2))  # every other block: scattered on the GPU
        slots = list(range(count))  # consecutive slots: one copy a kind
        save = KVTransfers(saves=[(kind, b, s) for kind in kinds for b, s in zip(blocks, slots)])
        load = KVTransfers(loads=[(kind, s, b + 1) for kind in kinds
                                  for b, s in zip(blocks, slots)])
        moved = count * sum(2 * args.block_size * config.num_key_value_heads * config.head_dim
                            * dtype.itemsize * config.layer_types.count(kind) for kind in kinds)
        mib = moved / 2**20
        row = {"blocks_per_kind": count, "bytes": moved,
               "save": _time(store, save, device, args.repeats),
               "load": _time(store, load, device, args.repeats)}
        rows.append(row)
        print(f"{count:5d} blocks ({mib:8.1f} MiB): save host {row['save']['host_ms']} ms, "
              f"compute {row['save']['compute_ms']} ms, landed {row['save']['landed_ms']} ms; "
              f"load host {row['load']['host_ms']} ms, compute {row['load']['compute_ms']} ms, "
              f"landed {row['load']['landed_ms']} ms", flush=True)
    record = {"benchmark": "kv_offload_copies", "preset": args.preset,
              "layers": len(config.layer_types), "block_size": args.block_size,
              "dtype": str(dtype), "rows": rows, "environment": environment(device)}
    write_json(args.out, record)
    return record


if __name__ == "__main__":
    main()

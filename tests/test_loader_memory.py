"""Loading a checkpoint streams it: the host never holds more than about one tensor beyond the
model, and each rank reads only its slices.

The memory test writes a sharded float32 checkpoint of ~425 MB whose largest tensor is 32 MiB,
and loads it in a fresh process (so the test process's own allocations do not blur the
measure) into an engine model whose parameters were built and touched first. This process
samples the loader's /proc/PID/status meanwhile (from outside, so the loader's GIL cannot hide
a peak). Two quantities are bounded:

- anonymous memory (RssAnon: heap, tensors): what loading copies or keeps; must grow by less
  than the largest tensor plus ALLOCATOR_SLACK.
- file-backed pages of the memory-mapped shards (RssFile): a shard's pages that were read stay
  mapped until it is released, so these grow by about one shard (of the checkpoint's own max
  shard size), never the checkpoint.

The whole-model copy that these bounds rule out is shown to be visible to the same probe.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import muse.checkpoint.reader as reader_module
from muse.checkpoint.layout import is_weights_file
from muse.init_checkpoint import init_random_checkpoint
from muse.kernels.backends import select_backends
from muse.model.decoder import EngineModel
from muse.model.loader import load_checkpoint
from muse.presets import tiny
from tests.layers.common import FakeGroup, RecordingSlice

REPO_ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
MAX_SHARD_BYTES = 48 * MiB
# What loading may add beyond one tensor: glibc keeps freed chunks below its mmap threshold
# (up to 32 MiB) in the heap instead of returning them, Python and safetensors allocate small
# objects per tensor (slice objects, views, names), and the measure is page-granular. Loading
# copies tensors from mapped shards straight into the parameters, so the measured growth is a
# fraction of a MiB; 64 MiB leaves room for the allocator without hiding a second large tensor
# or the model (425 MB here).
ALLOCATOR_SLACK = 64 * MiB


def big_config():
    """The tiny preset widened: every feature on, 106M parameters, largest tensor 32 MiB
    (embedding and LM head, 8192 x 1024 in float32), MoE tensors of 2-8 MiB."""
    preset = tiny()
    text = dataclasses.replace(preset.text_config, hidden_size=1024, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=128, num_hidden_layers=12,
                               layer_types=None, moe_intermediate_size=512,
                               moe_latent_size=256)
    return dataclasses.replace(preset, text_config=text, vision_config=None, audio_config=None,
                               name="loader-memory")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict:
    directory = tmp_path_factory.mktemp("loader_memory") / "checkpoint"
    config = big_config()
    init_random_checkpoint(config, directory, seed=0, dtype=torch.float32,
                           max_shard_bytes=MAX_SHARD_BYTES)
    with reader_module.CheckpointReader(directory) as reader:
        sizes = [torch.Size(reader.shape(name)).numel() * 4 for name in reader.names()]
    shards = [path.stat().st_size for path in directory.iterdir() if is_weights_file(path.name)
              and path.suffix == ".safetensors"]
    info = {"directory": str(directory), "largest_tensor": max(sizes), "total": sum(sizes),
            "largest_shard": max(shards), "shards": len(shards)}
    assert info["shards"] >= 8 and 300e6 < info["total"] < 600e6
    assert info["largest_tensor"] == 32 * MiB
    return info


# Runs in a fresh interpreter: builds the engine model, touches every parameter, loads the
# checkpoint between two timestamps, then checks the result against the reference model.
# MODE "hold" wraps get_slice to keep a full copy of each tensor: the leak the test must see.
CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    torch.set_num_threads(1)
    from muse.checkpoint import load_config, load_reference_model
    from muse.checkpoint.reader import CheckpointReader
    from muse.kernels.backends import select_backends
    from muse.model.decoder import EngineModel
    from muse.model.loader import load_checkpoint, route

    directory, mode = sys.argv[1], sys.argv[2]
    if mode == "hold":
        kept, get_slice = [], CheckpointReader.get_slice
        def holding(self, name):
            kept.append(self.get(name).clone())
            return get_slice(self, name)
        CheckpointReader.get_slice = holding

    def status():
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f)
        return {key: int(fields[key].split()[0]) * 1024
                for key in ("RssAnon", "RssFile", "VmRSS", "VmHWM")}

    config = load_config(directory)
    model = EngineModel(config.text_config, select_backends(torch.device("cpu")), torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()  # resident before the measure starts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status()
    start = time.monotonic()
    load_checkpoint(model, directory)
    end = time.monotonic()
    after = status()

    mismatched, unfilled = [], set(name for name, _ in model.named_parameters())
    if mode == "check":
        # Each engine parameter is its checkpoint tensors, fused ones in their part order.
        order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
        parts = {}
        reference = load_reference_model(directory)
        for name, tensor in reference.state_dict().items():
            target, arguments = route(name)
            parts.setdefault(target, []).append((order[arguments.get("shard_id")], tensor))
        for name, param in model.named_parameters():
            pieces = [tensor for _, tensor in sorted(parts.get(name, []), key=lambda p: p[0])]
            if pieces:
                unfilled.discard(name)
                if not torch.equal(param, torch.cat(pieces)):
                    mismatched.append(name)
    print(json.dumps({"before": before, "after": after, "start": start, "end": end,
                      "mismatched": mismatched, "unfilled": sorted(unfilled)}))
""")


def load_in_child(directory: str, mode: str) -> dict:
    """Run CHILD, sampling its RssAnon / RssFile every ~0.5 ms; the peaks while it loads."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen([sys.executable, "-c", CHILD, directory, mode], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    samples = []
    status_path = f"/proc/{process.pid}/status"
    while process.poll() is None:
        try:
            with open(status_path) as f:
                fields = dict(line.split(":", 1) for line in f)
            samples.append((time.monotonic(), int(fields["RssAnon"].split()[0]) * 1024,
                            int(fields["RssFile"].split()[0]) * 1024))
        except (OSError, KeyError):
            pass  # exiting (a zombie has no RssAnon)
        time.sleep(0.0005)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout.decode().strip().splitlines()[-1])
    during = [(anon, file) for t, anon, file in samples
              if result["start"] <= t <= result["end"]]
    assert during, "no sample was taken while loading"
    before = result["before"]
    result["samples"] = len(during)
    result["anon_growth"] = max(anon for anon, _ in during) - before["RssAnon"]
    result["file_growth"] = max(file for _, file in during) - before["RssFile"]
    # Peak of the whole resident set (anonymous + file-backed) since the reset, read after.
    result["hwm_growth"] = result["after"]["VmHWM"] - before["VmRSS"]
    return result


def test_loading_holds_one_tensor_beyond_the_model(big_checkpoint: dict) -> None:
    result = load_in_child(big_checkpoint["directory"], "check")
    largest, shard = big_checkpoint["largest_tensor"], big_checkpoint["largest_shard"]
    report = (f"anonymous growth {result['anon_growth'] / MiB:.1f} MiB, file-backed growth "
              f"{result['file_growth'] / MiB:.1f} MiB, resident peak growth "
              f"{result['hwm_growth'] / MiB:.1f} MiB over {result['samples']} samples; largest "
              f"tensor {largest / MiB:.0f} MiB, largest shard {shard / MiB:.1f} MiB, checkpoint "
              f"{big_checkpoint['total'] / MiB:.0f} MiB in {big_checkpoint['shards']} shards")
    print(report)
    assert result["anon_growth"] < largest + ALLOCATOR_SLACK, report
    assert result["file_growth"] < shard + ALLOCATOR_SLACK, report
    assert result["hwm_growth"] < largest + shard + ALLOCATOR_SLACK, report
    # Nothing stays behind either: the copies and the mappings are gone after loading.
    assert result["after"]["RssAnon"] - result["before"]["RssAnon"] < ALLOCATOR_SLACK, report
    assert result["after"]["RssFile"] - result["before"]["RssFile"] < ALLOCATOR_SLACK, report
    # The loaded model is the reference model's checkpoint, every parameter of it.
    assert result["unfilled"] == [] and result["mismatched"] == [], result


def test_the_probe_sees_a_whole_model_copy(big_checkpoint: dict) -> None:
    """The same measure, when each tensor read is also kept, shows the checkpoint's size:
    the bounds above would catch a loader that materialises the model."""
    result = load_in_child(big_checkpoint["directory"], "hold")
    assert result["anon_growth"] > 0.9 * big_checkpoint["total"], result["anon_growth"]


def test_load_checkpoint_reads_only_slices(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """At TP=2 (rank 1), `load_checkpoint` hands every loader a lazy slice, never a whole
    tensor, and reads exactly the elements of this rank's parameters, half of the sharded
    ones."""
    config = tiny()
    init_random_checkpoint(config, tmp_path, seed=3, dtype=torch.float32,
                           max_shard_bytes=2 * MiB)
    for module in ("muse.layers.linear", "muse.layers.embedding", "muse.layers.fused_moe"):
        monkeypatch.setattr(f"{module}.get_tp_group", lambda: FakeGroup(2, 1))
    model = EngineModel(config.text_config, select_backends(torch.device("cpu")), torch.float32)

    slices: dict[str, RecordingSlice] = {}
    get_slice = reader_module.CheckpointReader.get_slice

    def recording(self, name: str) -> RecordingSlice:
        slices[name] = RecordingSlice(get_slice(self, name))
        return slices[name]

    def whole(self, name: str) -> torch.Tensor:
        raise AssertionError(f"the loader read all of `{name}`")

    monkeypatch.setattr(reader_module.CheckpointReader, "get_slice", recording)
    monkeypatch.setattr(reader_module.CheckpointReader, "get", whole)
    load_checkpoint(model, tmp_path)
    monkeypatch.undo()  # the checks below read whole tensors themselves

    with reader_module.CheckpointReader(tmp_path) as reader:
        assert len(set(reader.file_of(name) for name in reader.names())) > 1  # sharded
        full = {name: torch.Size(reader.shape(name)).numel() for name in reader.names()}
        assert set(slices) == set(full)
        read = sum(source.elements_read for source in slices.values())
        # Every element of this rank's parameters comes from one read; the padding rows of
        # the vocabulary (none at vocab 8192 on 2 ranks) would be the only exception.
        assert read == sum(param.numel() for param in model.parameters())
        assert read < 0.6 * sum(full.values())
        # Column and row parallel layers read half their tensor: rank 1's rows / columns.
        prefix = "model.layers.0"
        for name, dim in ((f"{prefix}.self_attn.q_proj.weight", 0),
                          (f"{prefix}.self_attn.o_proj.weight", 1),
                          ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
            assert slices[name].elements_read == full[name] // 2, name
        q = reader.get(f"{prefix}.self_attn.q_proj.weight")
        k = reader.get(f"{prefix}.self_attn.k_proj.weight")
        v = reader.get(f"{prefix}.self_attn.v_proj.weight")
        o = reader.get(f"{prefix}.self_attn.o_proj.weight")
    attention = model.model.layers["0"].self_attn
    # 4 query heads and 2 KV heads of 16: rank 1 holds query heads 2-3 and KV head 1.
    expected = torch.cat([q[32:64], k[16:32], v[16:32]])
    torch.testing.assert_close(attention.qkv_proj.weight, expected, rtol=0, atol=0)
    torch.testing.assert_close(attention.o_proj.weight, o[:, 32:64], rtol=0, atol=0)

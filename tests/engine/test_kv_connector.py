"""The KV connector interface (`muse/disagg/connector.py`): the `SharedStorageConnector`
hands a prompt's blocks from one engine to a fresh one through a directory (the second
computes only the rest, with exactly the output of a full prefill, and uses what it read:
corrupted files change the output), and a connector class of one's own, named by
`kv_connector_module_path`, is called at each point the interface promises, its per-layer
hooks inside the forward pass too (each layer's K/V saved there is what the cache holds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from muse import LLM, SamplingParams
from muse.disagg.config import KVTransferConfig
from muse.disagg.connector import KVConnector

MODEL = "muse-spark-tiny"
BLOCK = 16
PROMPT = [(7 * i + 3) % 200 + 10 for i in range(5 * BLOCK + 3)]  # 5 full blocks and a tail
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def engine(**args) -> LLM:
    return LLM(MODEL, device="cpu", block_size=BLOCK, kv_cache_memory_bytes=8 * 2**20, **args)


def storage(role: str, path: Path) -> str:
    return json.dumps({"kv_role": role, "kv_connector": "SharedStorageConnector",
                       "kv_connector_extra_config": {"shared_storage_path": str(path)}})


def run(llm: LLM) -> tuple[list[int], int]:
    output = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), output.num_cached_tokens


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = engine()
    try:
        tokens, cached = run(llm)
    finally:
        llm.shutdown()
    assert cached == 0
    return tokens


def test_shared_storage_hands_the_prompt_to_a_fresh_engine(reference, tmp_path) -> None:
    producer = engine(kv_transfer_config=storage("kv_producer", tmp_path))
    try:
        assert run(producer) == (reference, 0)
    finally:
        producer.shutdown()  # its writes are done
    files = {kind: sorted((tmp_path / kind).glob("*.kv"))
             for kind in ("sliding_attention", "full_attention")}
    assert len(files["full_attention"]) == 5

    consumer = engine(kv_transfer_config=storage("kv_consumer", tmp_path))
    try:
        tokens, cached = run(consumer)
    finally:
        consumer.shutdown()
    assert tokens == reference
    assert cached == 5 * BLOCK

    # Negative control: the same files with other bytes give another output.
    for paths in files.values():
        for path in paths:
            data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
            path.write_bytes((data * -1.0 + 0.5).numpy().tobytes())
    corrupted = engine(kv_transfer_config=storage("kv_consumer", tmp_path))
    try:
        tokens, cached = run(corrupted)
    finally:
        corrupted.shutdown()
    assert cached == 5 * BLOCK and tokens != reference


class RecordingConnector(KVConnector):
    """Records the calls; keeps a finished request's blocks when asked to."""

    calls: list[tuple] = []

    def delay_free(self, kv_transfer_params):
        self.calls.append(("delay_free", kv_transfer_params))
        return bool(kv_transfer_params and kv_transfer_params.get("keep"))

    def start_load_kv(self, request_id, prompt_token_ids, cache_salt, kv_transfer_params):
        self.calls.append(("start_load_kv", request_id, len(prompt_token_ids), cache_salt))
        return None

    def request_finished(self, request):
        held = self.kv.kv_cache.block_tables(request)
        self.calls.append(("request_finished", request.request_id, request.finish_reason,
                           len(held["full_attention"])))

    def serve(self):
        if not self.calls or self.calls[-1] != ("serve",):
            self.calls.append(("serve",))


def test_a_connector_of_ones_own_is_called_at_each_point(reference) -> None:
    config = json.dumps({"kv_role": "kv_both", "kv_connector": "RecordingConnector",
                         "kv_connector_module_path": __name__})
    llm = engine(kv_transfer_config=config)
    RecordingConnector.calls.clear()
    try:
        tokens = llm.generate([{"prompt_token_ids": PROMPT, "cache_salt": "tenant"}], GREEDY,
                              use_tqdm=False)[0].outputs[0].token_ids
        engine_core = llm.engine
        engine_core.add_request("kept", PROMPT, GREEDY, kv_transfer_params={"keep": True})
        while engine_core.has_unfinished():
            engine_core.step()
        assert "kept" in engine_core.kv_cache.holds  # delay_free: the blocks stay held
        engine_core.kv_cache.release_hold("kept")
    finally:
        llm.shutdown()
    assert list(tokens) == reference
    names = [call[0] for call in RecordingConnector.calls]
    assert names.count("start_load_kv") == 2 and names.count("request_finished") == 2
    first = names.index("start_load_kv")
    assert RecordingConnector.calls[first][2:] == (len(PROMPT), "tenant")
    finished = [c for c in RecordingConnector.calls if c[0] == "request_finished"]
    assert all(c[2] == "length" and c[3] == 6 for c in finished)  # blocks still in place
    assert "serve" in names


class LayerConnector(KVConnector):
    """Saves each step's new K/V layer by layer, as a push-style connector would."""

    waits: list[int] = []
    saved: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (layer, slots, K rows)

    def wait_for_layer_load(self, position):
        self.waits.append(position)

    def save_kv_layer(self, position, kv_cache, meta):
        kind = next(k for k, layers in self.kv.layers.items() if position in layers)
        slots = meta.kinds[kind].slot_mapping
        k = kv_cache[0].flatten(0, 1)  # [blocks * block_size, heads, dim]
        self.saved.append((position, slots.clone(), k[slots].clone()))


def test_a_connectors_layer_hooks_run_around_every_layer(reference) -> None:
    config = json.dumps({"kv_role": "kv_both", "kv_connector": "LayerConnector",
                         "kv_connector_module_path": __name__})
    llm = engine(kv_transfer_config=config)
    LayerConnector.waits.clear()
    LayerConnector.saved.clear()
    try:
        assert llm.engine.executor.worker.eager_layers
        tokens = run(llm)[0]
        layers = len(llm.engine.model.layer_types)
        caches = llm.engine.executor.worker.kv_caches
    finally:
        llm.shutdown()
    assert tokens == reference  # the hooks change nothing
    steps = len(LayerConnector.waits) // layers
    assert steps >= GREEDY.max_tokens and LayerConnector.waits == list(range(layers)) * steps
    assert [position for position, _, _ in LayerConnector.saved] == list(range(layers)) * steps
    # Each layer's K rows of the step's tokens, as the hook saw them, are the cache's (the
    # sliding layers' slots of early tokens may have been reused since: global layers only).
    for position, slots, rows in LayerConnector.saved:
        if llm.engine.model.layer_types[position] == "full_attention":
            assert torch.equal(caches[position][0].flatten(0, 1)[slots], rows)
    # The first step is the prompt's prefill (the engine's chunk takes it whole).
    assert all(len(slots) == len(PROMPT) for _, slots, _ in LayerConnector.saved[:layers])


@pytest.mark.parametrize("fields, message", [
    ({"kv_connector": "SharedStorageConnector"}, "shared_storage_path"),
    ({"kv_connector": "Unknown"}, "kv_connector"),
    ({"kv_connector": "KVConnectorX", "kv_connector_module_path": "json"}, "not a KVConnector"),
])
def test_bad_connector_configs_name_the_field(fields, message, tmp_path) -> None:
    if "kv_connector_module_path" in fields:
        with pytest.raises(ValueError, match=message):
            engine(kv_transfer_config=json.dumps({"kv_role": "kv_both", **fields}))
        return
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.parse({"kv_role": "kv_both", **fields})

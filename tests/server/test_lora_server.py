"""A server with LoRA adapters (`--enable-lora --lora-modules`): the request's `model` selects
the adapter, `/v1/models` lists them, `POST /v1/load_lora_adapter` / `unload_lora_adapter`
change them at run time, and `POST /generate` returns token ids, log-probs and the adapter
version. Adapters are made with `peft` on muse's own reference model (attention, MLP, the
latent MoE's pooler and unpooler, and the routed experts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

peft = pytest.importorskip("peft")

from muse import LLM, SamplingParams  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from tests.live_server import MODEL, LiveServer, start_server, stop_server  # noqa: E402
from tests.lora.helpers import muse_adapter  # noqa: E402

PROMPT = [11, 200, 37, 5, 99, 140, 7, 64]
TOKENS = 10
@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"first": muse_adapter(root / "first", 1), "second": muse_adapter(root / "second", 2)}


@pytest.fixture(scope="module")
def offline(adapters) -> dict:
    """Greedy tokens of the base and each adapter run in this process (and the first's
    text)."""
    llm = LLM(MODEL, device="cpu", enable_lora=True, max_lora_rank=8, max_loras=2)
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outputs = {None: llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]}
    for number, (name, path) in enumerate(adapters.items(), start=1):
        outputs[name] = llm.generate([PROMPT], params, use_tqdm=False,
                                     lora_request=LoRARequest(name, number, str(path)))[0].outputs[0]
    tokens = {name: list(out.token_ids) for name, out in outputs.items()}
    assert tokens["first"] != tokens[None] and tokens["second"] != tokens["first"]
    return {**tokens, "text:first": outputs["first"].text}


@pytest.fixture(scope="module")
def served(server_logs: Path, adapters) -> Iterator[LiveServer]:
    live = start_server(server_logs, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
                        "--lora-modules", f"first={adapters['first']}")
    yield live
    stop_server(live)


def generate(server: LiveServer, **body) -> dict:
    with server.http() as http:
        response = http.post("/generate", json={
            "input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
            **body})
    assert response.status_code == 200, response.text
    return response.json()


def completion_text(server: LiveServer, model: str) -> str:
    with server.client() as client:
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return out.choices[0].text


def test_the_model_field_selects_the_adapter_and_models_lists_it(served, offline) -> None:
    with served.client() as client:
        listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL, "first"}
    assert listed["first"].parent == MODEL
    reply = generate(served, lora_path="first")
    assert reply["output_ids"] == offline["first"]
    assert reply["meta_info"]["weight_version"] == "1"
    assert len(reply["meta_info"]["output_token_logprobs"]) == TOKENS
    assert [entry[1] for entry in reply["meta_info"]["output_token_logprobs"]] \
        == reply["output_ids"]
    assert generate(served)["output_ids"] == offline[None]
    assert generate(served)["meta_info"]["weight_version"] == "base"
    assert completion_text(served, "first") == offline["text:first"]


def test_adapters_load_replace_and_unload_at_run_time(served, adapters, offline) -> None:
    with served.http() as http:
        loaded = http.post("/v1/load_lora_adapter",
                           json={"lora_name": "second", "lora_path": str(adapters["second"])})
        assert loaded.status_code == 200, loaded.text
        assert generate(served, lora_path="second")["output_ids"] == offline["second"]
        again = http.post("/v1/load_lora_adapter",
                          json={"lora_name": "second", "lora_path": str(adapters["first"])})
        assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
        # New weights for a loaded name (a trainer's next version).
        replaced = http.post("/v1/load_lora_adapter",
                             json={"lora_name": "second", "lora_path": str(adapters["first"]),
                                   "load_inplace": True})
        assert replaced.status_code == 200, replaced.text
        reply = generate(served, lora_path="second")
        assert reply["output_ids"] == offline["first"]
        assert reply["meta_info"]["weight_version"] == "2"
        assert http.post("/v1/unload_lora_adapter",
                         json={"lora_name": "second"}).status_code == 200
        missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "second"})
        assert missing.status_code == 404
        bad = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "broken", "lora_path": "/nonexistent"})
        assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
        unknown = http.post("/generate", json={"input_ids": PROMPT, "lora_path": "second"})
        assert unknown.status_code == 404
    with served.client() as client:
        assert {m.id for m in client.models.list().data} == {MODEL, "first"}

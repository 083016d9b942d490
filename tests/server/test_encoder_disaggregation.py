"""Encoder disaggregation with the router (E + PD, on the CPU): an encoder instance
(`--ec-transfer-config` ec_producer) encodes a chat request's image into shared storage and
answers without tokens; `muse router --encode ... --decode ...` sends media requests there
first, and the instance behind it (ec_consumer) answers as one plain instance does. Text
requests skip the encoder instance; a dead encoder instance costs nothing but time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.live_server import MODEL, LiveServer, start_server, stop_server
from tests.server.test_media_parts import ask, data_url, image_part, png_bytes


def ec_flag(role: str, storage: Path) -> tuple[str, str]:
    return ("--ec-transfer-config", json.dumps({
        "ec_role": role, "ec_connector": "ECSharedStorageConnector",
        "ec_connector_extra_config": {"shared_storage_path": str(storage)}}))


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("encoder-outputs")


@pytest.fixture(scope="module")
def layout(server_logs: Path, storage: Path) -> Iterator[dict[str, LiveServer]]:
    common = ("--max-model-len", "1024")
    servers: dict[str, LiveServer] = {}
    try:
        servers["plain"] = start_server(server_logs, *common)
        servers["encode"] = start_server(server_logs, *common, *ec_flag("ec_producer", storage))
        servers["pd"] = start_server(server_logs, *common, *ec_flag("ec_consumer", storage))
        servers["router"] = start_server(
            server_logs, "--encode", servers["encode"].base_url, "--decode",
            servers["pd"].base_url, model=None, command_name="router")
        yield servers
    finally:
        for live in servers.values():
            stop_server(live)


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_the_encoder_instance_encodes_and_answers_without_tokens(layout, storage):
    reply = ask(client_of(layout["encode"]), image_part(data_url(png_bytes(21), "image/png")))
    assert reply.choices[0].finish_reason == "length"
    assert not reply.choices[0].message.content
    assert reply.usage.completion_tokens == 0
    assert len(list(storage.rglob("*.safetensors"))) == 1


def test_the_router_answers_media_requests_as_one_instance_does(layout, storage):
    routed, plain = client_of(layout["router"]), client_of(layout["plain"])
    before = len(list(storage.rglob("*.safetensors")))
    for seed in (31, 32):
        part = image_part(data_url(png_bytes(seed), "image/png"))
        assert ask(routed, part).choices[0].message.content \
            == ask(plain, part).choices[0].message.content
    assert len(list(storage.rglob("*.safetensors"))) == before + 2  # encoded by the E instance
    text = [{"role": "user", "content": "Say something."}]
    got = routed.chat.completions.create(model=MODEL, messages=text, max_tokens=8,
                                         temperature=0)
    want = plain.chat.completions.create(model=MODEL, messages=text, max_tokens=8,
                                         temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content


def test_a_dead_encoder_instance_leaves_the_encoding_to_the_next_one(layout, storage):
    stop_server(layout["encode"])
    before = len(list(storage.rglob("*.safetensors")))
    part = image_part(data_url(png_bytes(41), "image/png"))
    got = ask(client_of(layout["router"]), part)
    assert got.choices[0].message.content \
        == ask(client_of(layout["plain"]), part).choices[0].message.content
    assert len(list(storage.rglob("*.safetensors"))) == before

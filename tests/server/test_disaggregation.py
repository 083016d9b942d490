"""Prefill / decode disaggregation on the CPU: two prefill instances, a decode instance and
`muse router` in front of them answer the OpenAI client as one instance does, the decode
instance reuses the prefilled blocks, every instance frees its blocks, and dead prefill
instances give retries, then 503s, never a hang."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from muse import SamplingParams
from tests.engine.helpers import random_prompt, tiny_llm
from tests.live_server import (MAX_MODEL_LEN, MODEL, PARSER_FLAGS, LiveServer, free_port,
                               start_server, stop_server)
from tests.server.helpers import metric, read_metrics, wait_until

PROMPT = "Count with me: " + " ".join(f"item {i}," for i in range(40))
QUESTION = [{"role": "user", "content": "Tell me a long story about " + "a red fox, " * 12}]


@pytest.fixture(scope="module")
def layout(server_logs: Path) -> Iterator[dict[str, LiveServer]]:
    common = (*PARSER_FLAGS, "--max-model-len", str(MAX_MODEL_LEN))
    servers: dict[str, LiveServer] = {}
    try:
        for name in ("prefill-1", "prefill-2"):
            config = {"kv_role": "kv_producer", "kv_port": free_port()}
            servers[name] = start_server(server_logs, *common, "--kv-transfer-config",
                                         json.dumps(config))
        servers["decode"] = start_server(server_logs, *common, "--kv-transfer-config",
                                         '{"kv_role": "kv_consumer"}')
        servers["router"] = start_server(
            server_logs, "--prefill", servers["prefill-1"].base_url,
            servers["prefill-2"].base_url, "--decode", servers["decode"].base_url,
            model=None, command_name="router")
        yield servers
    finally:
        for live in servers.values():
            stop_server(live)


def router_client(layout: dict[str, LiveServer]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{layout['router'].base_url}/v1", api_key="unused",
                         max_retries=0, timeout=60)


def test_the_router_answers_as_one_instance_does(layout, client):
    routed = router_client(layout)
    for _ in range(2):  # each prefill instance in turn
        want = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0)
        got = routed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                        temperature=0)
        assert got.choices[0].text == want.choices[0].text
        # The decode instance computed only the prompt's last block itself.
        assert got.usage.prompt_tokens_details.cached_tokens >= got.usage.prompt_tokens - 16
    want = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                          temperature=0)
    got = routed.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                         temperature=0)
    assert got.choices[0].message.content == want.choices[0].message.content
    stream = routed.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20,
                                            temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)
    assert streamed == want.choices[0].message.content
    with pytest.raises(openai.BadRequestError):  # a bad request comes back as it is
        routed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=9)


def test_every_instance_frees_its_blocks(layout):
    def used(name: str) -> float:
        return metric(read_metrics(layout[name].base_url), "muse_kv_cache_blocks_used")

    # The prefill instances let go of the blocks they held once the decode instance pulled.
    wait_until(lambda: all(used(name) == 0 for name in ("prefill-1", "prefill-2", "decode")),
               20, "every instance's blocks freed")


def test_dead_prefill_instances_give_retries_then_503s(layout):
    routed = router_client(layout)
    stop_server(layout["prefill-1"])
    for _ in range(2):  # the dead one is skipped
        reply = routed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                          temperature=0)
        assert reply.choices[0].text
    stop_server(layout["prefill-2"])
    began = time.monotonic()
    with pytest.raises(openai.APIStatusError) as raised:
        routed.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
    assert raised.value.status_code == 503
    assert time.monotonic() - began < 30


def test_a_failed_pull_computes_the_prompt_on_the_decode_instance():
    decode = tiny_llm(kv_transfer_config={"kv_role": "kv_consumer",
                                          "kv_transfer_timeout_s": 2})
    prompt = random_prompt(70, 1)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = tiny_llm().generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    nowhere = {"do_remote_prefill": True, "remote_host": "127.0.0.1",
               "remote_port": free_port(), "remote_request_id": "gone"}
    (request,) = decode.engine.add_request("r", prompt, params, kv_transfer_params=nowhere)
    while decode.engine.has_unfinished():
        decode.engine.step()
    assert request.num_cached_tokens == 0
    assert request.output_token_ids == want[0].outputs[0].token_ids
    assert sum(pool.num_used for pool in decode.engine.kv_cache.pools.values()) == 0


@pytest.mark.parametrize(("value", "message"), [
    ('{"kv_role": "kv_both"', "not valid JSON"),
    ({"kv_role": "sender"}, "kv_role"),
    ({}, "needs `kv_role`"),
    ({"kv_role": "kv_producer", "kv_port": 0}, "kv_port"),
    ({"kv_role": "kv_producer", "color": "red"}, "unknown fields"),
])
def test_bad_kv_transfer_configs_are_refused(value, message):
    from muse.engine.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(kv_transfer_config=value).validate()


def test_the_nixl_connector_without_nixl_is_a_clear_error(monkeypatch):
    from muse.disagg import nixl_plane
    from muse.engine.args import EngineArgs

    monkeypatch.setattr(nixl_plane, "nixl_available", lambda: False)
    with pytest.raises(ValueError, match="pip install nixl"):
        EngineArgs(kv_transfer_config={"kv_role": "kv_producer",
                                       "kv_connector": "NixlConnector"}).validate()


def test_vllm_fields_are_accepted():
    from muse.disagg.config import KVTransferConfig

    config = KVTransferConfig.parse('{"kv_role": "kv_consumer", "kv_rank": 1, '
                                    '"kv_parallel_size": 2, "kv_buffer_device": "cuda"}')
    assert config.is_consumer and not config.is_producer


def test_a_pull_waits_beside_the_steps_of_other_requests():
    # In one process: a prefill engine, and a decode engine whose pull stays unanswered
    # until the prefill engine serves pulls, while another request decodes to the end.
    port = free_port()
    prefill = tiny_llm(kv_transfer_config={"kv_role": "kv_producer", "kv_port": port})
    decode = tiny_llm(kv_transfer_config={"kv_role": "kv_consumer"})
    prompt, other = random_prompt(70, 1), random_prompt(20, 2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = tiny_llm().generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    prefill.engine.add_request("p", prompt, SamplingParams(max_tokens=1),
                               kv_transfer_params={"do_remote_decode": True})
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    assert prefill.engine.kv_cache.holds  # kept for the pull
    where = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
             "remote_request_id": "p"}
    (waiting,) = decode.engine.add_request("d", prompt, params, kv_transfer_params=where)
    (beside,) = decode.engine.add_request("o", other, params)
    while not beside.is_finished:
        decode.engine.step()
    assert waiting.num_computed_tokens == 0 and "d" in decode.engine.kv_waiting
    while decode.engine.has_unfinished():
        prefill.engine.serve_kv_pulls()
        decode.engine.step()
    assert waiting.num_cached_tokens == 64
    assert waiting.output_token_ids == want[0].outputs[0].token_ids
    assert not prefill.engine.kv_cache.holds  # let go once pulled

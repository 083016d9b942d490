"""Malformed and hostile requests get the right 4xx with an OpenAI-shaped error body, and the
server keeps serving; API keys; back-pressure when the waiting queue is full."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.live_server import MAX_MODEL_LEN, MODEL
from tests.server.helpers import (
    WEATHER_TOOL,
    engine_idle,
    metric,
    read_metrics,
    wait_until,
)

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ANY = object()  # the error names some parameter, or none; either is fine


def chat(**fields) -> dict:
    # max_tokens keeps a request that is wrongly accepted short.
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **fields}


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


def user_parts(*parts: dict) -> dict:
    return chat(messages=[{"role": "user", "content": list(parts)}])


def schema_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
LONG_TEXT = "word " * (2 * MAX_MODEL_LEN)  # a token per word: twice the context

# (id, path, body (a dict is sent as JSON, bytes as they are), status, error.param)
BAD_REQUESTS = [
    ("temperature-string", CHAT, chat(temperature="hot"), 400, "temperature"),
    ("messages-not-a-list", CHAT, chat(messages="hi"), 400, "messages"),
    ("messages-missing", CHAT, {"model": MODEL}, 400, "messages"),
    ("message-not-an-object", CHAT, chat(messages=[None]), 400, ANY),
    ("message-without-role", CHAT, chat(messages=[{"content": "hi"}]), 400, ANY),
    ("max-tokens-fraction", CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    ("n-huge", CHAT, chat(n=1000), 400, "n"),
    ("n-zero", CHAT, chat(n=0), 400, "n"),
    ("max-tokens-negative", CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", CHAT, chat(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-over-context", CHAT, chat(max_tokens=100_000), 400, "max_tokens"),
    ("max-completion-tokens-over-context", CHAT, chat(max_completion_tokens=100_000), 400,
     ANY),
    ("completion-max-tokens-over-context", COMPLETIONS, completion(max_tokens=MAX_MODEL_LEN),
     400, "max_tokens"),
    ("cache-salt-empty", CHAT, chat(cache_salt=""), 400, "cache_salt"),
    ("cache-salt-number", COMPLETIONS, completion(cache_salt=7), 400, "cache_salt"),
    ("unknown-model", CHAT, chat(model="gpt-17"), 404, "model"),
    ("unknown-model-completions", COMPLETIONS, completion(model="gpt-17"), 404, "model"),
    ("bad-json", CHAT, b'{"model": "muse-spark-tiny", "messages": [', 400, None),
    ("json-array-body", CHAT, b'[{"role": "user", "content": "hi"}]', 400, None),
    ("json-string-body", COMPLETIONS, b'"hi"', 400, None),
    ("not-utf8-body", CHAT, b"\xff\xfe\xfd{}", 400, None),
    ("deeply-nested-json", CHAT, b"[" * 100_000 + b"]" * 100_000, 400, None),
    ("response-format-unknown-type", CHAT, chat(response_format={"type": "nonsense"}), 400,
     "response_format.type"),
    ("json-schema-unknown-type", CHAT, chat(response_format=schema_format({"type": "nonsense"})),
     400, "response_format"),
    ("json-schema-dangling-ref", CHAT, chat(response_format=schema_format(
        {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}})),
     400, "response_format"),
    ("json-schema-missing", CHAT, chat(response_format={"type": "json_schema"}), 400,
     "response_format.json_schema"),
    ("json-schema-stream", CHAT, chat(stream=True, response_format=schema_format(
        {"type": "nonsense"})), 400, "response_format"),
    ("messages-empty", CHAT, chat(messages=[]), 400, "messages"),
    ("image-url-invalid", CHAT, user_parts({"type": "image_url",
                                            "image_url": {"url": "not a url"}}),
     400, "messages[0].content[0].image_url.url"),
    ("image-not-supported", CHAT, user_parts(
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/llama.png"}}),
     400, "messages[0].content[1]"),
    ("audio-not-supported", CHAT, user_parts(
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
     400, "messages[0].content[0]"),
    ("content-part-unknown-type", CHAT, user_parts({"type": "hologram", "hologram": {}}), 400,
     "messages[0].content[0].type"),
    ("content-part-text-not-string", CHAT, user_parts({"type": "text", "text": 5}), 400, ANY),
    ("prompt-over-context-chat", CHAT, chat(messages=[{"role": "user", "content": LONG_TEXT}]),
     400, "messages"),
    ("prompt-over-context-completions", COMPLETIONS, completion(prompt=LONG_TEXT), 400,
     "prompt"),
    ("role-unknown", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role"),
    ("temperature-negative", CHAT, chat(temperature=-1), 400, "temperature"),
    ("temperature-too-high", CHAT, chat(temperature=5), 400, "temperature"),
    ("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    ("top-p-over-one", CHAT, chat(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", CHAT, chat(top_k=-5), 400, "top_k"),
    ("top-k-beyond-int64", CHAT, chat(top_k=2**70), 400, "top_k"),
    ("min-p-over-one", CHAT, chat(min_p=2), 400, "min_p"),
    ("presence-penalty-too-high", CHAT, chat(presence_penalty=3), 400, "presence_penalty"),
    ("repetition-penalty-zero", CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-string", CHAT, chat(seed="abc"), 400, "seed"),
    ("seed-beyond-int64", CHAT, chat(seed=2**70), 400, "seed"),
    ("stream-not-bool", CHAT, chat(stream="yes please"), 400, "stream"),
    ("completion-logprobs-50", COMPLETIONS, completion(logprobs=50), 400, "logprobs"),
    ("chat-top-logprobs-30", CHAT, chat(logprobs=True, top_logprobs=30), 400, "top_logprobs"),
    ("chat-top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400,
     "top_logprobs"),
    ("logit-bias-key-not-integer", CHAT, chat(logit_bias={"llama": 5}), 400, "logit_bias"),
    ("logit-bias-token-out-of-range", CHAT, chat(logit_bias={"99999999": 5}), 400,
     "logit_bias"),
    ("logit-bias-value-out-of-range", CHAT, chat(logit_bias={"5": 1000}), 400, "logit_bias"),
    ("stop-token-ids-out-of-range", CHAT, chat(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("stop-token-ids-negative", CHAT, chat(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop-empty-string", CHAT, chat(stop=[""]), 400, "stop"),
    ("min-tokens-over-max-tokens", CHAT, chat(min_tokens=50, max_tokens=10), 400,
     "min_tokens"),
    ("prompt-token-out-of-vocab", COMPLETIONS, completion(prompt=[1, 2, 10**6]), 400,
     "prompt"),
    ("prompt-token-negative", COMPLETIONS, completion(prompt=[1, 2, -5]), 400, "prompt"),
    ("prompt-empty-list", COMPLETIONS, completion(prompt=[]), 400, "prompt"),
    ("prompt-empty-token-list", COMPLETIONS, completion(prompt=[[]]), 400, "prompt"),
    ("prompt-missing", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    ("prompt-object", COMPLETIONS, completion(prompt={"text": "hi"}), 400, ANY),
    ("suffix-unsupported", COMPLETIONS, completion(suffix="end"), 400, "suffix"),
    ("tool-choice-names-unknown-tool", CHAT, chat(
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     400, "tool_choice"),
    ("tool-choice-required-without-tools", CHAT, chat(tool_choice="required"), 400,
     "tool_choice"),
    ("tool-choice-named-without-tools", CHAT, chat(tool_choice=FORCE_WEATHER), 400,
     "tool_choice"),
    ("tool-choice-auto-without-tools", CHAT, chat(tool_choice="auto"), 400, "tool_choice"),
    ("tool-choice-unknown-mode", CHAT, chat(tools=[WEATHER_TOOL], tool_choice="sometimes"),
     400, ANY),
    ("tool-name-invalid", CHAT, chat(tools=[{"type": "function",
                                             "function": {"name": "get weather!"}}]),
     400, "tools[0].function.name"),
    ("tool-parameters-invalid-schema", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
        tool_choice="required"), 400, "tools"),
    ("forced-tool-with-response-format", CHAT, chat(
        tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER, response_format={"type": "json_object"}),
     400, "response_format"),
    ("tokenize-neither-prompt-nor-messages", "/tokenize", {"model": MODEL}, 400, ANY),
    ("tokenize-unknown-model", "/tokenize", {"model": "gpt-17", "prompt": "hi"}, 404, "model"),
    ("detokenize-out-of-range", "/detokenize", {"model": MODEL, "tokens": [10**7]}, 400,
     "tokens"),
    ("detokenize-not-a-list", "/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens"),
    # A lone UTF-16 surrogate (`"\ud800"` in JSON) is no Unicode text: refused wherever it is.
    ("surrogate-in-prompt", COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400,
     "prompt"),
    ("surrogate-in-stop", COMPLETIONS, b'{"prompt": "a", "stop": ["\\udfff"]}', 400,
     "stop[0]"),
    ("surrogate-in-model", CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", '
     b'"content": "hi"}]}', 400, "model"),
    ("surrogate-in-message", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     400, "messages[0].content"),
    ("surrogate-in-tokenize", "/tokenize", b'{"prompt": "\\udc00"}', 400, "prompt"),
    ("tokenize-malformed-tool-calls", "/tokenize", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"function": 5}]}]}, 400, "messages"),
    ("tokenize-tool-calls-not-objects", "/tokenize", {"messages": [
        {"role": "assistant", "tool_calls": ["x"]}]}, 400, ANY),
    ("json-schema-nested-deeply", CHAT, chat(response_format=schema_format(
        nested_schema(300))), 400, "response_format"),
    ("tool-parameters-nested-deeply", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f",
                                                 "parameters": nested_schema(300)}}],
        tool_choice="required"), 400, "tools"),
    ("body-nested-deeply", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     400, ANY),
]

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error"}


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/no-such-route", 404), ("POST", "/v1/chat/completion", 404),
    ("GET", "/v1/chat/completions", 405), ("DELETE", "/v1/models", 405)])
def test_routing_errors_are_openai_shaped(server, method, path, status):
    with server.http() as http:
        response = http.request(method, path)
    error = check_error_body(response, status)
    assert path in error["message"]


def check_error_body(response: httpx.Response, status: int, param=ANY) -> dict:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], (str, int)) and error["code"]
    assert error["param"] is None or isinstance(error["param"], str)
    if status in ERROR_TYPES:
        assert error["type"] == ERROR_TYPES[status]
    if param is not ANY:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(("path", "body", "status", "param"),
                         [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS])
def test_bad_request_is_refused(server, path, body, status, param):
    with server.http() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type":
                                                              "application/json"})
        else:
            response = http.post(path, json=body)
    check_error_body(response, status, param)


def test_server_still_serves_after_the_bad_requests(server, client):
    wait_until(lambda: engine_idle(server.base_url), 30, "the engine going idle")
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                           extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_openai_client_reads_the_error_fields(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    assert refused.value.status_code == 400
    assert refused.value.param == "temperature"
    assert refused.value.type == "invalid_request_error"
    assert refused.value.code
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


# ---- a server with an API key and a tiny queue ------------------------------------------

def test_wrong_api_key_is_refused(guarded_server):
    with guarded_server.client(api_key="sk-wrong") as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        assert refused.value.status_code == 401
        assert refused.value.type == "authentication_error"
        assert refused.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


@pytest.mark.parametrize("headers", [{}, {"Authorization": "sk-muse-test-key"},
                                     {"Authorization": "Basic c2stbXVzZS10ZXN0LWtleQ=="}],
                         ids=["missing", "no-bearer", "basic"])
def test_missing_api_key_is_refused(guarded_server, headers):
    response = httpx.post(f"{guarded_server.v1}/chat/completions", headers=headers,
                          json=chat(), timeout=30)
    check_error_body(response, 401)


def test_right_api_key_is_served(guarded_server):
    with guarded_server.client() as client:
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 3
        assert [m.id for m in client.models.list().data] == [MODEL]
    # Health checks need no key; everything else does.
    assert httpx.get(f"{guarded_server.base_url}/health", timeout=30).status_code == 200
    with guarded_server.http() as http:
        assert http.get("/metrics").status_code == 200
        assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/metrics"), ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"),
    ("GET", "/openapi.json"), ("GET", "/version"), ("GET", "/v1/models"),
    ("GET", "/no-such-route")])
def test_every_route_but_health_needs_the_key(guarded_server, method, path):
    response = httpx.request(method, f"{guarded_server.base_url}{path}", timeout=30,
                             json={"prompt": "hi"} if method == "POST" else None)
    check_error_body(response, 401)


def test_auto_tool_choice_needs_the_server_flags(guarded_server):
    with guarded_server.http() as http:
        response = http.post(CHAT, json=chat(tools=[WEATHER_TOOL], tool_choice="auto"))
    check_error_body(response, 400, "tool_choice")


def test_full_queue_answers_429_with_retry_after(guarded_server):
    """One request runs, one waits (max_queued_requests 1): the next ones get 429."""
    base_url = guarded_server.base_url

    async def scenario():
        async with guarded_server.async_client() as client:
            running = await client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1500, stream=True,
                extra_body={"ignore_eos": True})
            await running.__anext__()  # it holds the only sequence slot now
            waiting = asyncio.ensure_future(client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, extra_body={"ignore_eos": True}))

            def one_waits() -> bool:
                samples = read_metrics(base_url, guarded_server.api_key)
                return metric(samples, "vllm:num_requests_running") == 1 and \
                    metric(samples, "vllm:num_requests_waiting") == 1

            await asyncio.to_thread(wait_until, one_waits, 30, "a request waiting")
            refused = await asyncio.gather(*(
                client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8)
                for _ in range(4)), return_exceptions=True)
            await running.close()  # frees the slot for the waiting request
            return refused, await waiting

    refused, waited = asyncio.run(scenario())
    assert len(refused) == 4
    for error in refused:
        assert isinstance(error, openai.APIStatusError), error
        assert error.status_code == 429
        assert error.response.headers.get("retry-after") is not None
        assert int(error.response.headers["retry-after"]) >= 0
        assert error.code == "overloaded" and error.type
    assert waited.choices[0].finish_reason == "length"
    assert waited.usage.completion_tokens == 8
    wait_until(lambda: engine_idle(base_url, guarded_server.api_key), 30, "the engine going idle")
    samples = read_metrics(base_url, guarded_server.api_key)
    assert metric(samples, "muse_requests_total", status="http_429") >= 4

"""The OpenAI-compatible API of a live `muse serve`, through the official `openai` client.

The preset's weights are random, so texts are gibberish; what the tests rely on is that they
are deterministic for a seed, that counts add up, and that constrained outputs (tool calls,
JSON) are valid whatever the weights.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import defaultdict

import jsonschema
import openai
import pytest

import muse
from muse.chat_format import TOOL_CALL_START_ID
from muse.tokenizer import PAD_ID, MuseTokenizer
from tests.live_server import MAX_MODEL_LEN, MODEL
from tests.server.helpers import (
    TOOL_SCHEMAS,
    TOOLS,
    engine_idle,
    metric,
    read_metrics,
    wait_until,
)

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Tell me about llamas."}]
PROMPT = "The llama is a domesticated South American camelid"
# Random weights sample EOS now and then; tests that count tokens switch it off.
NO_EOS = {"ignore_eos": True}

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]},
                 "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def reasoning_of(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def tokenize(server, **body) -> list[int]:
    with server.http() as http:
        response = http.post("/tokenize", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["count"] == len(result["tokens"])
    return result["tokens"]


def collect_chat_stream(stream) -> dict:
    """Texts, reasoning, finish reasons, logprob entries and usage of a chat stream."""
    out = {"content": defaultdict(str), "reasoning": defaultdict(str), "finish": {},
           "logprobs": defaultdict(list), "usage": None, "ids": set(), "roles": {}}
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        out["ids"].add(chunk.id)
        if not chunk.choices:
            assert out["usage"] is None, "one usage chunk, at the end"
            out["usage"] = chunk.usage
            continue
        assert out["usage"] is None, "no choices after the usage chunk"
        for choice in chunk.choices:
            assert choice.index not in out["finish"], "no deltas after finish_reason"
            delta = choice.delta
            if delta.role is not None:
                out["roles"][choice.index] = delta.role
            out["content"][choice.index] += delta.content or ""
            out["reasoning"][choice.index] += reasoning_of(delta) or ""
            if choice.logprobs is not None and choice.logprobs.content:
                out["logprobs"][choice.index] += choice.logprobs.content
            if choice.finish_reason is not None:
                out["finish"][choice.index] = choice.finish_reason
    assert len(out["ids"]) == 1, "every chunk carries the completion's id"
    return out


def collect_completion_stream(stream) -> dict:
    out = {"text": defaultdict(str), "finish": {}, "stop_reason": {},
           "tokens": defaultdict(list), "usage": None}
    for chunk in stream:
        if not chunk.choices:
            assert out["usage"] is None
            out["usage"] = chunk.usage
            continue
        for choice in chunk.choices:
            assert choice.index not in out["finish"], "no text after finish_reason"
            out["text"][choice.index] += choice.text
            if choice.logprobs is not None:
                out["tokens"][choice.index] += choice.logprobs.tokens
            if choice.finish_reason is not None:
                out["finish"][choice.index] = choice.finish_reason
                out["stop_reason"][choice.index] = (choice.model_extra or {}).get("stop_reason")
    return out


def same_usage(a, b) -> bool:
    return (a.prompt_tokens, a.completion_tokens, a.total_tokens) == \
        (b.prompt_tokens, b.completion_tokens, b.total_tokens)


# ---- discovery and utility routes -------------------------------------------------------

def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_health_and_version(server):
    with server.http() as http:
        assert http.get("/health").status_code == 200
        version = http.get("/version")
    assert version.status_code == 200
    assert version.json() == {"version": muse.__version__}


def test_tokenize_detokenize_round_trip(server):
    text = "The quick brown fox jumps over the lazy dog."
    plain = tokenize(server, prompt=text, add_special_tokens=False)
    with_specials = tokenize(server, prompt=text, add_special_tokens=True)
    assert plain and with_specials[-len(plain):] == plain
    with server.http() as http:
        response = http.post("/detokenize", json={"model": MODEL, "tokens": plain})
    assert response.status_code == 200, response.text
    assert response.json()["prompt"] == text


def test_tokenize_messages_counts_the_chat_prompt(server, client):
    tokens = tokenize(server, messages=MESSAGES)
    user_tokens = tokenize(server, prompt=MESSAGES[0]["content"], add_special_tokens=False)
    assert len(tokens) > len(user_tokens)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == len(tokens)


# ---- chat and completions ---------------------------------------------------------------

def test_chat_completion(server, client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                           seed=7, extra_body=NO_EOS)
    assert reply.object == "chat.completion"
    assert reply.id and reply.model == MODEL
    [choice] = reply.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is None
    usage = reply.usage
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens == len(tokenize(server, messages=MESSAGES))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion(server, client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, seed=7,
                                      extra_body=NO_EOS)
    assert reply.object == "text_completion" and reply.model == MODEL
    [choice] = reply.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text
    assert reply.usage.completion_tokens == 10
    assert reply.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 10


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_matches_the_whole_reply(client, n):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=16, n=n, seed=11,
                   temperature=1.0, extra_body=NO_EOS)
    whole = client.chat.completions.create(**request)
    streamed = collect_chat_stream(client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}))
    assert len(whole.choices) == n
    assert sorted(c.index for c in whole.choices) == list(range(n))
    assert streamed["roles"] == {i: "assistant" for i in range(n)}
    assert streamed["finish"] == {i: "length" for i in range(n)}
    for choice in whole.choices:
        assert choice.finish_reason == "length"
        assert streamed["content"][choice.index] == (choice.message.content or "")
        assert streamed["reasoning"][choice.index] == (reasoning_of(choice.message) or "")
    assert whole.usage.completion_tokens == 16 * n
    assert streamed["usage"] is not None and same_usage(streamed["usage"], whole.usage)
    if n == 2:  # each sample of a seeded request draws from its own stream
        first, second = whole.choices
        assert (first.message.content, reasoning_of(first.message)) != \
            (second.message.content, reasoning_of(second.message))


@pytest.mark.parametrize("n", [1, 2])
def test_completion_stream_matches_the_whole_reply(client, n):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=16, n=n, seed=5, temperature=1.0,
                   extra_body=NO_EOS)
    whole = client.completions.create(**request)
    streamed = collect_completion_stream(client.completions.create(
        **request, stream=True, stream_options={"include_usage": True}))
    assert sorted(c.index for c in whole.choices) == list(range(n))
    assert streamed["finish"] == {i: "length" for i in range(n)}
    for choice in whole.choices:
        assert streamed["text"][choice.index] == choice.text
    assert whole.usage.completion_tokens == 16 * n
    assert streamed["usage"] is not None and same_usage(streamed["usage"], whole.usage)
    if n == 2:
        assert whole.choices[0].text != whole.choices[1].text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_times_every_token_even_without_text(client, endpoint):
    # The padding token is a hidden special token: forced by logit_bias, every generated token
    # adds no text, yet each step must still send a chunk with the usage so far.
    request = dict(model=MODEL, max_tokens=8, logit_bias={str(PAD_ID): 100}, extra_body=NO_EOS,
                   stream=True, stream_options={"include_usage": True,
                                                "continuous_usage_stats": True})
    if endpoint == "chat":
        stream = client.chat.completions.create(messages=MESSAGES, **request)
    else:
        stream = client.completions.create(prompt=PROMPT, **request)
    counts, texts = [], []
    for chunk in stream:
        assert chunk.usage is not None, "every chunk carries the usage"
        counts.append(chunk.usage.completion_tokens)
        for choice in chunk.choices:
            texts.append(choice.text if endpoint == "completions" else choice.delta.content)
    assert counts == sorted(counts) and counts[-1] == 8
    assert len(set(counts) - {0}) == 8, "one chunk per generated token"
    assert not "".join(t or "" for t in texts)


def test_completion_of_several_prompts_with_n(server, client):
    prompts = ["First prompt", "A second, longer prompt"]
    reply = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, seed=3,
                                      extra_body=NO_EOS)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 4 * 4
    assert reply.usage.prompt_tokens == sum(len(tokenize(server, prompt=p)) for p in prompts)


# ---- logprobs and usage -----------------------------------------------------------------

def test_chat_logprobs_count_the_tokens(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body=NO_EOS)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 10
    for entry in entries:
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert all(t.logprob <= 0 for t in top)
        # Greedy decoding picks the most likely token.
        assert entry.token == top[0].token
        assert entry.logprob == pytest.approx(top[0].logprob)


def test_chat_logprobs_without_top_logprobs(client):
    """`logprobs: true` alone asks for the chosen tokens' logprobs (no alternatives)."""
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                           logprobs=True, extra_body=NO_EOS)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None, "logprobs=true without top_logprobs returned no logprobs"
    assert len(logprobs.content) == 6
    assert all(entry.top_logprobs == [] for entry in logprobs.content)


def test_chat_logprob_bytes_of_single_byte_tokens(client):
    """`bytes` exists for tokens that are not whole characters: it must be their own bytes."""
    tokenizer = MuseTokenizer.base()
    # Byte-level tokens for 0xC3 and 0xB6, the two halves of "ö"; the bias forces them.
    byte_tokens = {tokenizer.token_to_id("Ã"): 0xC3, tokenizer.token_to_id("¶"): 0xB6}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=1, logit_bias={str(t): 100 for t in byte_tokens}, extra_body=NO_EOS)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        assert entry.bytes in ([0xC3], [0xB6]), \
            f"token {entry.token!r} reports bytes {entry.bytes}"


def test_completion_logprobs_with_echo(server, client):
    prompt_ids = tokenize(server, prompt=PROMPT)
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, logprobs=2,
                                      echo=True, temperature=0, extra_body=NO_EOS)
    [choice] = reply.choices
    assert choice.text.startswith(PROMPT)
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 8
    logprobs = choice.logprobs
    total = len(prompt_ids) + 8
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == total
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == total
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    for chosen, top in zip(logprobs.token_logprobs[-8:], logprobs.top_logprobs[-8:], strict=True):
        assert chosen == pytest.approx(max(top.values()))  # greedy


def test_completion_logprobs_count_the_tokens(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, logprobs=0,
                                      seed=2, extra_body=NO_EOS)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 7
    assert reply.usage.completion_tokens == 7


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_streamed_completion_logprobs_match_the_whole_reply(client, echo):
    """Streamed chunks carry the same tokens and text offsets as the whole reply."""
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=1, echo=echo,
                   temperature=0, extra_body=NO_EOS)
    whole = client.completions.create(**request).choices[0]
    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(**request, stream=True):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens
            offsets += choice.logprobs.text_offset
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset


def test_usage_counts_tokens_up_to_a_natural_stop(client):
    """Without ignore_eos a reply may end early; usage still counts what was produced."""
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, logprobs=0,
                                      seed=9)
    [choice] = reply.choices
    assert reply.usage.completion_tokens == len(choice.logprobs.tokens)
    if choice.finish_reason == "length":
        assert reply.usage.completion_tokens == 30
    else:
        assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 30


# ---- seeds ------------------------------------------------------------------------------

def test_seed_makes_chat_sampling_reproducible(client):
    def sample(seed: int) -> tuple:
        message = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0, seed=seed,
            extra_body=NO_EOS).choices[0].message
        return message.content, reasoning_of(message)

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3)}) >= 2


def test_seed_makes_completion_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=1.0, seed=seed,
                                         extra_body=NO_EOS).choices[0].text

    assert sample(99) == sample(99)
    assert len({sample(seed) for seed in (1, 2, 3)}) >= 2


# ---- stop strings -----------------------------------------------------------------------

def stop_string_in(text: str) -> str:
    """Three plain characters from the middle of `text`, to use as a stop string."""
    for start in range(4, len(text) - 3):
        candidate = text[start:start + 3]
        if candidate.isascii() and candidate.isalnum():
            return candidate
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_a_completion(client):
    request = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0,
                   extra_body=NO_EOS)
    full = client.completions.create(**request).choices[0].text
    stop = stop_string_in(full)
    cut_at = full.index(stop)

    reply = client.completions.create(**request, stop=[stop])
    [choice] = reply.choices
    assert choice.text == full[:cut_at]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert reply.usage.completion_tokens < 32

    kept = client.completions.create(
        **{**request, "extra_body": {**NO_EOS, "include_stop_str_in_output": True}},
        stop=[stop]).choices[0]
    assert kept.text == full[:cut_at + len(stop)] and kept.finish_reason == "stop"

    streamed = collect_completion_stream(client.completions.create(**request, stop=[stop],
                                                                   stream=True))
    assert streamed["text"][0] == full[:cut_at]
    assert streamed["finish"] == {0: "stop"}
    assert streamed["stop_reason"] == {0: stop}


def test_stop_string_cuts_a_chat_reply(client):
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=32, temperature=0,
                   extra_body=NO_EOS)
    full = client.chat.completions.create(**request).choices[0].message.content
    stop = stop_string_in(full)
    choice = client.chat.completions.create(**request, stop=stop).choices[0]
    assert choice.message.content == full[:full.index(stop)]
    assert choice.finish_reason == "stop"
    streamed = collect_chat_stream(client.chat.completions.create(**request, stop=stop,
                                                                  stream=True))
    assert streamed["content"][0] == full[:full.index(stop)]
    assert streamed["finish"] == {0: "stop"}


# ---- tool calls -------------------------------------------------------------------------

TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris this week?"}]


def check_tool_calls(calls: list[tuple[str, str, str]]) -> None:
    """(id, name, arguments JSON) of each call: ids unique, arguments valid for the tool."""
    assert calls, "no tool calls"
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    for call_id, name, arguments in calls:
        assert call_id
        assert name in TOOL_SCHEMAS
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_returns_valid_calls(client, seed):
    reply = client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=256, seed=seed)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert all(call.type == "function" for call in calls or [])
    check_tool_calls([(c.id, c.function.name, c.function.arguments) for c in calls or []])
    assert not choice.message.content


@pytest.mark.parametrize("seed", [0, 1])
def test_named_tool_choice_calls_that_tool(client, seed):
    reply = client.chat.completions.create(
        model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS, max_tokens=256, seed=seed,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    check_tool_calls([(c.id, c.function.name, c.function.arguments) for c in calls])


@pytest.mark.parametrize("seed", [0, 3])
def test_required_tool_choice_streams_valid_calls(client, seed):
    stream = client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS,
                                            tool_choice="required", max_tokens=256, seed=seed,
                                            stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert finish is None, "no deltas after finish_reason"
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None,
                                                      "arguments": ""})
                if delta.id:
                    assert call["id"] is None, "a call's id comes once"
                    call["id"] = delta.id
                if delta.function and delta.function.name:
                    assert call["name"] is None, "a call's name comes once"
                    call["name"] = delta.function.name
                if delta.function and delta.function.arguments:
                    call["arguments"] += delta.function.arguments
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert sorted(calls) == list(range(len(calls)))
    check_tool_calls([(c["id"], c["name"], c["arguments"]) for c in calls.values()])


@pytest.mark.parametrize("seed", [0, 1])
def test_strict_functions_under_auto_tool_choice_give_valid_calls(client, seed):
    """`"strict": true` functions under tool_choice "auto" (SGLang's behaviour): a reply pushed
    to open a call (a logit bias on `<tool_call>`) writes one valid call, and without
    parallel calls nothing after it. The same request without `strict` writes no valid call
    (negative control), from the same prompt: `strict` is not shown to the model."""
    request = dict(model=MODEL, messages=TOOL_MESSAGES, max_tokens=128, seed=seed,
                   temperature=1.0, parallel_tool_calls=False,
                   logit_bias={str(TOOL_CALL_START_ID): 100})
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    reply = client.chat.completions.create(**request, tools=strict)
    [choice] = reply.choices
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1
    check_tool_calls([(c.id, c.function.name, c.function.arguments) for c in calls])
    loose = client.chat.completions.create(**request, tools=TOOLS)
    assert not loose.choices[0].message.tool_calls
    assert loose.usage.prompt_tokens == reply.usage.prompt_tokens


def test_auto_tool_choice_is_accepted(client):
    reply = client.chat.completions.create(model=MODEL, messages=TOOL_MESSAGES, tools=TOOLS,
                                           tool_choice="auto", max_tokens=8, seed=0)
    [choice] = reply.choices
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or []:
        assert call.function.name in TOOL_SCHEMAS


# ---- structured output ------------------------------------------------------------------

def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(client, seed):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=256,
                                           seed=seed,
                                           response_format=json_schema_format(PERSON_SCHEMA))
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON_SCHEMA)


@pytest.mark.parametrize("seed", [0, 1])
def test_json_schema_output_validates_when_streamed(client, seed):
    streamed = collect_chat_stream(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=256, seed=seed, stream=True,
        response_format=json_schema_format(PERSON_SCHEMA)))
    assert streamed["finish"] == {0: "stop"}
    jsonschema.validate(json.loads(streamed["content"][0]), PERSON_SCHEMA)


def test_json_schema_output_of_a_completion_validates(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=256, seed=4,
                                      extra_body={"response_format":
                                                  json_schema_format(PERSON_SCHEMA)})
    jsonschema.validate(json.loads(reply.choices[0].text), PERSON_SCHEMA)


CHOICES = ["alpaca", "llama", "guanaco \"wild\"", "vicu\u00f1a"]


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"choice": CHOICES}}, lambda text: text in CHOICES),
    ({"guided_choice": CHOICES}, lambda text: text in CHOICES),
    ({"structured_outputs": {"regex": "[a-z]{2,6}-[0-9]{3}"}},
     lambda text: re.fullmatch("[a-z]{2,6}-[0-9]{3}", text)),
    ({"guided_grammar": 'root ::= "pack of " [2-9] " " ("llamas" | "alpacas")'},
     lambda text: re.fullmatch("pack of [2-9] (llamas|alpacas)", text)),
    ({"structured_outputs": {"json": json.dumps(PERSON_SCHEMA)}},
     lambda text: jsonschema.validate(json.loads(text), PERSON_SCHEMA) is None),
], ids=["choice", "guided_choice", "regex", "guided_grammar", "json_text"])
def test_vllm_structured_outputs_hold(client, extra, check):
    """vLLM's `structured_outputs` and its earlier `guided_*` fields, in chat (thinking off:
    the grammar holds from the first token) and completions."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=256,
                                          seed=3, extra_body={**extra, **NO_THINKING})
    assert chat.choices[0].finish_reason == "stop"
    assert check(chat.choices[0].message.content)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=256, seed=3,
                                           extra_body=extra)
    assert completion.choices[0].finish_reason == "stop"
    assert check(completion.choices[0].text)


@pytest.mark.parametrize(("extra", "param"), [
    ({"structured_outputs": {"regex": "[a-z"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),
], ids=["bad-regex", "bad-grammar", "no-choices", "two-kinds", "bad-json", "two-fields"])
def test_bad_structured_outputs_are_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       extra_body=extra)
    assert error.value.body["param"] == param


# Seeds whose random-weight replies close their object within max_tokens (the others write a
# string past 512 tokens: valid so far, but unfinished).
@pytest.mark.parametrize("seed", [1, 2, 4])
def test_json_object_output_parses(client, seed):
    # Thinking off, so the grammar holds from the first token (no reasoning block to wait for).
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=512,
                                           seed=seed, response_format={"type": "json_object"},
                                           extra_body=NO_THINKING)
    [choice] = reply.choices
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "max_length"])
def test_json_schema_strings_hold_no_raw_control_characters(client, bounded):
    """JSON forbids raw control characters in strings; the grammar must too, with or without
    a length bound. The bias makes the model write the byte 0x1C wherever the grammar allows
    it, and else close the string."""
    tokenizer = MuseTokenizer.base()
    control = tokenizer.token_to_id("Ĝ")  # the byte-level token of 0x1C
    assert tokenizer.decode([control]) == "\x1c"
    quote = tokenizer.token_to_id('"')
    code = {"type": "string", "maxLength": 6} if bounded else {"type": "string"}
    schema = {"type": "object", "properties": {"code": code}, "required": ["code"],
              "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=64, temperature=0,
        logit_bias={str(control): 100, str(quote): 50},
        response_format=json_schema_format(schema))
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), schema)


# ---- metrics and the prefix cache -------------------------------------------------------

METRIC_NAMES = [
    "muse_requests_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "muse_kv_cache_blocks_used",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
]


def test_metrics_count_a_request(server, client):
    wait_until(lambda: engine_idle(server.base_url), 30, "the engine going idle")
    before = read_metrics(server.base_url)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9,
                                           extra_body=NO_EOS)
    # The request is counted once its response has ended, just after the client has it.
    wait_until(lambda: metric(read_metrics(server.base_url), "muse_requests_total",
                              status="finished")
               > metric(before, "muse_requests_total", status="finished"), 30,
               "the request counted")
    after = read_metrics(server.base_url)
    names = {name for name, _ in after}
    assert not [name for name in METRIC_NAMES if name not in names]

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("muse_requests_total", status="finished") == 1
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:request_generation_tokens_sum") == 9
    assert grew("vllm:prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") == reply.usage.completion_tokens == 9
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == 8


def test_metrics_count_refused_requests(server, client):
    before = read_metrics(server.base_url)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    with server.http() as http:
        assert http.get("/v1/no-such-route").status_code == 404

    def grew(status: str) -> float:
        return metric(read_metrics(server.base_url), "muse_requests_total", status=status) \
            - metric(before, "muse_requests_total", status=status)

    wait_until(lambda: grew("http_404") >= 2, 30, "the 404s counted")
    # Each refused request is counted exactly once, whatever refused it.
    assert grew("http_400") == 1 and grew("http_404") == 2


def test_cache_salt_separates_prefixes_and_reset_clears_them(server, client):
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"item {i}," for i in range(150))

    def cached_tokens(**fields) -> int:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                          extra_body=fields or None)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens(cache_salt="tenant-a") == 0
    assert cached_tokens(cache_salt="tenant-b") == 0  # another tenant: no hit
    assert cached_tokens() == 0  # no salt is its own tenant
    assert cached_tokens(cache_salt="tenant-a") > 0
    with server.http() as http:
        assert http.post("/reset_prefix_cache").status_code == 200
    assert cached_tokens(cache_salt="tenant-a") == 0
    assert cached_tokens(cache_salt="tenant-a") > 0


def test_prefix_cache_hits_on_a_repeated_prompt(server, client):
    # A fresh prefix (so the first request misses) a few hundred tokens long.
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"item {i}," for i in range(150))
    before = read_metrics(server.base_url)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    after = read_metrics(server.base_url)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 256
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    hits = metric(after, "vllm:prefix_cache_hits_total") - \
        metric(before, "vllm:prefix_cache_hits_total")
    assert hits >= cached

"""Grammar compiles off the engine loop: other requests keep decoding, limits on time, size and
depth, a byte-bounded cache, and failures that reach the client as clean 4xx errors."""

from __future__ import annotations

import json
import re
import threading
import time
from types import SimpleNamespace

import pytest

from muse import SamplingParams
from muse.engine.errors import InvalidRequestError
from muse.engine.grammar_cache import GrammarCache
from muse.engine.grammar_compiler import clean_error_message
from muse.engine.request import RequestStatus
from muse.engine.structured_output import MAX_SCHEMA_DEPTH, StructuredOutput
from muse.server.engine_loop import EngineLoop
from muse.server.messages import AddRequest, RequestFailed, SampleDelta, Shutdown
from tests.engine.helpers import random_prompt, tiny_llm

# Short replies whatever the weights: the grammar leaves a few choices.
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
          "additionalProperties": False}
OTHER_SCHEMA = {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"],
                "additionalProperties": False}
BAD_SCHEMA = StructuredOutput("json_schema", schema='{"type": "nonsense"}')
# xgrammar's raw messages start with a time and a C++ source location.
SOURCE_LOCATION = re.compile(r"\.(cc|cpp|h)\b|/project/|\[\d\d:\d\d:\d\d\]")


def constrained(spec: StructuredOutput, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_output=spec)


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def step_until(engine, done, max_steps: int = 2000) -> list:
    """Step until `done()`; returns every request the steps reported."""
    reported = []
    for _ in range(max_steps):
        if done():
            return reported
        reported += engine.step()
    raise AssertionError("the engine did not get there")


class GatedCompile:
    """Stands in for a slow compile: each call blocks until the test opens the gate."""

    def __init__(self, compile_fn) -> None:
        self.compile_fn = compile_fn
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def __call__(self, spec):
        self.calls += 1
        self.started.set()
        self.gate.wait(timeout=60)
        return self.compile_fn(spec)


@pytest.fixture
def gated(request):
    """A tiny engine whose compiles wait for `gate`; engine args come from the parameter."""
    llm = tiny_llm(**getattr(request, "param", {}))
    compiler = llm.engine._grammar_jobs().compiler
    slow = GatedCompile(compiler.compile)
    compiler.compile = slow
    yield llm.engine, slow
    slow.gate.set()


# ---- compiling beside the loop ----------------------------------------------------------
def test_a_compiling_grammar_does_not_hold_up_other_requests(gated):
    engine, slow = gated
    [waiting] = engine.add_request("constrained", random_prompt(12, 1),
                                   constrained(StructuredOutput.for_schema(SCHEMA)))
    [plain] = engine.add_request("plain", random_prompt(12, 2),
                                 SamplingParams(max_tokens=8, ignore_eos=True))
    assert slow.started.wait(timeout=30)
    step_until(engine, lambda: plain.is_finished)
    assert len(plain.output_token_ids) == 8
    # Still compiling: never scheduled, no KV blocks.
    assert not waiting.output_token_ids and waiting.status == RequestStatus.WAITING
    assert waiting not in engine.scheduler.waiting and waiting not in engine.scheduler.running
    assert waiting.request_id not in engine.kv_cache.requests
    slow.gate.set()
    step_until(engine, lambda: waiting.is_finished)
    assert waiting.error is None and waiting.finish_reason == "stop"
    text = engine.tokenizer.decode(waiting.output_token_ids[:-1])
    assert set(json.loads(text)) == {"a"}


def test_requests_for_one_grammar_share_a_compile_and_later_ones_hit_the_cache(gated):
    engine, slow = gated
    spec = StructuredOutput.for_schema(SCHEMA)
    first = engine.add_request("first", random_prompt(6, 1), constrained(spec))
    second = engine.add_request("second", random_prompt(6, 2), constrained(spec))
    slow.gate.set()
    step_until(engine, lambda: all(r.is_finished for r in first + second))
    assert slow.calls == 1
    [third] = engine.add_request("third", random_prompt(6, 3), constrained(spec))
    assert third in engine.scheduler.waiting  # no compile: schedulable at once
    assert slow.calls == 1


@pytest.mark.parametrize("gated", [dict(grammar_compile_threads=1)], indirect=True)
def test_an_aborted_request_drops_a_compile_that_has_not_started(gated):
    engine, slow = gated
    engine.add_request("running", random_prompt(6, 1), constrained(StructuredOutput("json")))
    engine.add_request("queued", random_prompt(6, 2),
                       constrained(StructuredOutput.for_schema(SCHEMA)))
    assert slow.started.wait(timeout=30)
    engine.abort("queued")
    assert "queued" not in engine.grammar_waiting and "queued" not in engine.requests
    slow.gate.set()
    step_until(engine, lambda: not engine.has_unfinished())
    assert slow.calls == 1  # the aborted request's schema was never compiled


# ---- failures ---------------------------------------------------------------------------
@pytest.mark.parametrize("gated", [dict(grammar_compile_timeout_s=0.3,
                                        grammar_compile_threads=1)], indirect=True)
def test_a_compile_past_the_time_limit_fails_its_request(gated):
    engine, slow = gated
    [slow_one] = engine.add_request("slow", random_prompt(6, 1),
                                    constrained(StructuredOutput.for_schema(SCHEMA)))
    assert slow.started.wait(timeout=30)
    # The only compile thread is taken, so this one never starts.
    [queued] = engine.add_request("queued", random_prompt(6, 2),
                                  constrained(StructuredOutput.for_schema(OTHER_SCHEMA)))
    reported = step_until(engine, lambda: slow_one.is_finished and queued.is_finished)
    assert slow_one in reported and queued in reported
    assert slow_one.finish_reason == "error" and not slow_one.output_token_ids
    assert "took too long to compile" in str(slow_one.error)
    assert slow_one.error.param == "response_format" and slow_one.error.status == 400
    assert "busy" in str(queued.error) and queued.error.status == 503
    assert not engine.has_unfinished() and not engine.kv_cache.requests


def test_a_schema_xgrammar_refuses_fails_from_the_step_without_source_paths():
    engine = tiny_llm().engine
    samples = engine.add_request("bad", random_prompt(6, 1),
                                 SamplingParams(n=2, max_tokens=4, structured_output=BAD_SCHEMA))
    reported = step_until(engine, lambda: all(s.is_finished for s in samples))
    assert reported == samples
    error = samples[0].error
    assert isinstance(error, InvalidRequestError) and error.param == "response_format"
    assert 'Unsupported type "nonsense"' in str(error)
    assert not SOURCE_LOCATION.search(str(error)), str(error)
    assert not engine.has_unfinished()


def test_the_offline_api_raises_for_a_schema_that_does_not_compile():
    llm = tiny_llm()
    with pytest.raises(InvalidRequestError, match="response_format") as raised:
        llm.generate([random_prompt(6, 1)], constrained(BAD_SCHEMA), use_tqdm=False)
    assert not SOURCE_LOCATION.search(str(raised.value))
    assert not llm.engine.has_unfinished()


def test_the_engine_loop_sends_a_failure_found_in_a_step_as_request_failed():
    engine = tiny_llm().engine
    inbox = [[AddRequest("bad", random_prompt(6, 1),
                         SamplingParams(n=2, max_tokens=4, structured_output=BAD_SCHEMA))],
             [AddRequest("good", random_prompt(6, 2), SamplingParams(max_tokens=3))]]
    sent: list = []
    give_up = time.monotonic() + 60

    def receive(timeout: float) -> list:
        if inbox:
            return inbox.pop()
        finished = any(isinstance(m, RequestFailed) for m in sent) and any(
            isinstance(m, SampleDelta) and m.finish_reason for m in sent)
        return [Shutdown()] if finished or time.monotonic() > give_up else []

    EngineLoop(engine, receive, sent.extend).run()
    [failure] = [m for m in sent if isinstance(m, RequestFailed)]  # one for both samples
    assert (failure.request_id, failure.param, failure.status) == ("bad", "response_format", 400)
    assert "nonsense" in failure.message
    assert {m.request_id for m in sent if isinstance(m, SampleDelta)} == {"good"}


def test_xgrammar_messages_lose_their_time_source_path_and_echoed_input():
    raw = RuntimeError("[14:58:46] /project/cpp/json_schema_converter.cc:5077: Check failed: "
                       "(error.empty()) is false: Failed to parse JSON: syntax error at line 1 "
                       "near: ot json. The JSON string is:" + "x" * 10_000 + "\n")
    assert clean_error_message(raw) == \
        "Failed to parse JSON: syntax error at line 1 near: ot json."
    raw = RuntimeError("[14:52:59] /project/cpp/regex_converter.cc:94: Regex parsing error at "
                       "position 3: The parenthesis is not closed.\n")
    assert clean_error_message(raw) == \
        "Regex parsing error at position 3: The parenthesis is not closed."


# ---- size and depth ---------------------------------------------------------------------
def test_a_deep_schema_is_refused_naming_the_field():
    with pytest.raises(InvalidRequestError, match=f"more than {MAX_SCHEMA_DEPTH} levels") as raised:
        StructuredOutput.for_schema(nested_schema(300))  # was a RecursionError (a 500)
    assert raised.value.param == "response_format"
    StructuredOutput.for_schema(nested_schema(MAX_SCHEMA_DEPTH // 2 - 1))
    tool = {"name": "f", "parameters": nested_schema(100)}
    with pytest.raises(InvalidRequestError) as raised:
        StructuredOutput.for_tools([tool], parallel=False)
    assert raised.value.param == "tools"


def test_a_large_schema_is_refused_before_compiling():
    enum = {"enum": [f"value_{i:06d}" for i in range(100_000)]}  # about 1.5 MB of JSON
    with pytest.raises(InvalidRequestError, match="too large") as raised:
        StructuredOutput.for_schema(enum)
    assert raised.value.param == "response_format"
    with pytest.raises(InvalidRequestError, match="too large") as raised:
        StructuredOutput.for_tools([{"name": "f", "parameters": enum}], parallel=False)
    assert raised.value.param == "tools"


def test_the_engine_checks_size_and_depth_at_admission():
    engine = tiny_llm(max_grammar_bytes=3_000).engine
    levels = MAX_SCHEMA_DEPTH // 2 + 1  # each level is a schema object and its properties
    deep = StructuredOutput("json_schema", schema='{"properties": {"a": ' * levels
                            + '{"type": "integer"}' + "}}" * levels)
    large = StructuredOutput("json_schema", schema=json.dumps({"enum": list(range(1_000))}))
    for spec, fragment in ((deep, "levels deep"), (large, "over the limit of 3,000")):
        with pytest.raises(InvalidRequestError, match=fragment) as raised:
            engine.add_request("r", random_prompt(6, 1), constrained(spec))
        assert raised.value.param == "response_format"
    assert not engine.has_unfinished() and not engine.grammar_waiting


# ---- the cache --------------------------------------------------------------------------
def grammar(size: int) -> SimpleNamespace:
    return SimpleNamespace(memory_size_bytes=size)


def test_the_grammar_cache_evicts_least_recently_used_by_bytes():
    cache = GrammarCache(max_bytes=100)
    cache.put("a", grammar(40))
    cache.put("b", grammar(40))
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("c", grammar(40))
    assert "b" not in cache and "a" in cache and "c" in cache and cache.num_bytes == 80
    cache.put("huge", grammar(101))  # larger than the whole bound: not kept
    assert "huge" not in cache and cache.num_bytes == 80
    cache.put("d", grammar(100))
    assert len(cache) == 1 and "d" in cache and cache.num_bytes == 100


def test_the_engine_keeps_compiled_grammars_within_its_byte_bound():
    engine = tiny_llm(grammar_cache_bytes=120_000).engine
    specs = [StructuredOutput.for_schema({"enum": [f"{name}_{i}" for i in range(300)]})
             for name in ("left", "right", "middle")]
    for index, spec in enumerate(specs):
        samples = engine.add_request(str(index), random_prompt(6, index), constrained(spec, 2))
        step_until(engine, lambda: all(s.is_finished for s in samples))
    cache = engine.grammar_jobs.cache
    assert 0 < cache.num_bytes <= 120_000 and len(cache) == 2
    assert specs[-1] in cache
    # xgrammar's own cache (unbounded by default) stays off.
    assert engine.runner.grammar_compiler.compiler.get_cache_size_bytes() == 0

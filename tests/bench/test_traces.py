"""Workload traces without a server: seeded generation, JSONL round trips, sizing, scaling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from muse.bench.agentic import (
    MESSAGE_OVERHEAD_TOKENS,
    AgenticSettings,
    generate_agentic,
)
from muse.bench.client import RequestOptions, body_digest, request_body
from muse.bench.random_lengths import RandomSettings, generate_random
from muse.bench.runner import Level, LevelRun, RequestRecord
from muse.bench.shared_prefix import (
    SEED_INPUT_TOKENS,
    SEED_PREFIX_TOKENS,
    SharedPrefixSettings,
    generate_shared_prefix,
)
from muse.bench.summary import SLO, summarize
from muse.bench.text import python_source
from muse.bench.tokens import CharsPerToken, Sizer
from muse.bench.trace import Trace, TraceError, load_trace, save_trace

COUNTER = CharsPerToken(4.0)


def small_traces(seed: int) -> dict[str, Trace]:
    agentic = AgenticSettings(num_sessions=3, system_tokens=300, user_tokens=(20, 60),
                              turns=(3, 5), tool_result_tokens=(10, 200),
                              output_tokens=(5, 30), think_time_s=(0.0, 1.0))
    shared = SharedPrefixSettings(num_groups=3, requests_per_group=2, input_tokens=400,
                                  prefix_tokens=300, output_tokens=5)
    lengths = RandomSettings(num_requests=5, input_tokens=(50, 300), output_tokens=(4, 16))
    return {"agentic": generate_agentic(agentic, Sizer(COUNTER), seed),
            "shared-prefix": generate_shared_prefix(shared, Sizer(COUNTER), seed),
            "random": generate_random(lengths, Sizer(COUNTER), seed)}


def test_generation_is_deterministic_per_seed() -> None:
    first, again, other = small_traces(7), small_traces(7), small_traces(8)
    for name in first:
        assert first[name] == again[name], name
        assert first[name].sessions != other[name].sessions, name


def test_a_larger_agentic_trace_begins_with_the_smaller_one() -> None:
    settings = AgenticSettings(num_sessions=2, system_tokens=100, turns=(2, 4),
                               user_tokens=(10, 20), tool_result_tokens=(10, 50),
                               output_tokens=(5, 10))
    small = generate_agentic(settings, Sizer(COUNTER), 3)
    settings.num_sessions = 4
    large = generate_agentic(settings, Sizer(COUNTER), 3)
    assert large.sessions[:2] == small.sessions


def test_saving_then_loading_gives_the_same_trace_and_requests(tmp_path: Path) -> None:
    options = RequestOptions(model="m")
    for name, trace in small_traces(1).items():
        path = tmp_path / f"{name}.jsonl"
        save_trace(trace, path)
        loaded = load_trace(path)
        assert loaded == trace, name
        for original, replayed in zip(trace.sessions, loaded.sessions):
            history_a, history_b = [], []
            for turn_a, turn_b in zip(original.turns, replayed.turns):
                history_a += turn_a.messages + [{"role": "assistant", "content": turn_a.assistant}]
                history_b += turn_b.messages + [{"role": "assistant", "content": turn_b.assistant}]
                assert body_digest(request_body(history_a, turn_a.output_tokens, options)) == \
                    body_digest(request_body(history_b, turn_b.output_tokens, options))


def test_a_user_trace_without_header_loads_and_bad_fields_are_named(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    turn = {"messages": [{"role": "user", "content": "hi"}], "output_tokens": 4}
    path.write_text(json.dumps({"id": "a", "turns": [turn, {**turn, "delay_s": 1.5}]}) + "\n\n")
    trace = load_trace(path)
    assert trace.workload == "replay" and trace.num_requests == 2
    assert trace.sessions[0].turns[1].delay_s == 1.5
    path.write_text(json.dumps({"turns": [{**turn, "output_tokens": 0}]}) + "\n")
    with pytest.raises(TraceError, match=r"mine.jsonl:1: turns\[0\].output_tokens"):
        load_trace(path)


def test_agentic_sessions_resend_history_and_stay_in_the_context() -> None:
    settings = AgenticSettings(num_sessions=4, system_tokens=200, user_tokens=(20, 40),
                               turns=(30, 40), tool_result_tokens=(20, 120),
                               output_tokens=(10, 20), max_context_tokens=1200)
    trace = generate_agentic(settings, Sizer(COUNTER), 0)
    system = trace.sessions[0].turns[0].messages[0]
    for session in trace.sessions:
        first = session.turns[0]
        assert first.messages[0] == system  # one agent, one system prompt for every session
        assert [m["role"] for m in first.messages] == ["system", "user"]
        for turn in session.turns[1:]:
            assert turn.messages[0]["content"].startswith("EXECUTION RESULT of [")
            assert turn.assistant and turn.delay_s >= 0
        # The context cap ends sessions early.
        assert len(session.turns) < 30
        last = session.turns[-1]
        assert last.intended_input_tokens + last.output_tokens + MESSAGE_OVERHEAD_TOKENS \
            <= settings.max_context_tokens


def test_shared_prefixes_are_shared_in_a_group_and_only_there() -> None:
    trace = small_traces(2)["shared-prefix"]
    assert [s.group for s in trace.sessions] == ["g000", "g001", "g002"] * 2  # round by round
    prefixes = {}
    for session in trace.sessions:
        system, user = session.turns[0].messages
        prefixes.setdefault(session.group, set()).add(system["content"])
        assert COUNTER.count(system["content"]) == pytest.approx(300, abs=2)
        assert COUNTER.count(user["content"]) == pytest.approx(100, abs=2)
    assert all(len(p) == 1 for p in prefixes.values())
    first_lines = {next(iter(p)).split("\n")[0] for p in prefixes.values()}
    assert len(first_lines) == 3


def test_sizer_cuts_text_to_the_token_budget() -> None:
    sizer = Sizer(COUNTER)
    for budget in (1, 17, 250, 4000):
        text = sizer.fit(python_source, "s", budget)
        assert abs(COUNTER.count(text) - budget) <= max(1, budget // 200)
    assert sizer.fit(python_source, "s", 500) == sizer.fit(python_source, "s", 500)


def test_default_lengths_follow_the_seed_setting_and_shrink_to_the_context() -> None:
    full = SharedPrefixSettings.for_context(262_144)
    assert (full.num_groups, full.requests_per_group, full.input_tokens, full.prefix_tokens,
            full.output_tokens) == (8, 8, SEED_INPUT_TOKENS, SEED_PREFIX_TOKENS, 20)
    tiny = SharedPrefixSettings.for_context(2048)
    tiny.validate(2048)
    assert tiny.prefix_tokens / tiny.input_tokens == pytest.approx(
        SEED_PREFIX_TOKENS / SEED_INPUT_TOKENS, abs=0.01)
    AgenticSettings.for_context(2048).validate()
    RandomSettings.for_context(2048).validate(2048)
    with pytest.raises(ValueError, match="--input-tokens"):
        SharedPrefixSettings(input_tokens=4000, prefix_tokens=100).validate(2048)


def test_summary_definitions() -> None:
    def record(ttft: float, e2e: float, tokens: int) -> RequestRecord:
        return RequestRecord(0, "s", 0, 0.0, ttft, e2e, [0.1] * (tokens - 1), 100, tokens, 40,
                             tokens, 100, tokens, "x")

    run = LevelRun(Level(0, 2, None, 2), [record(0.5, 1.5, 11), record(1.0, 3.0, 11)], 4.0)
    summary = summarize(run, num_gpus=2, slo=SLO(ttft_ms=600), server_prefix_cache=None)
    assert summary["total_tokens_per_s"] == pytest.approx((200 + 22) / 4.0)
    assert summary["total_tokens_per_s_per_gpu"] == pytest.approx((200 + 22) / 8.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx((100 + 200) / 2)
    # per-user tokens/s = (output tokens - 1) / (e2e - ttft)
    assert summary["per_user_tokens_per_s"]["p50"] == pytest.approx((10 / 1.0 + 10 / 2.0) / 2)
    assert summary["prefix_cache"]["usage_hit_rate"] == pytest.approx(0.4)
    assert summary["goodput"]["requests_per_s"] == pytest.approx(1 / 4.0)
    assert summary["goodput"]["attainment"] == pytest.approx(0.5)

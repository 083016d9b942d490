"""`muse bench serve` against a live tiny-model server: every workload, briefly, with the
figures checked against what the server itself counted."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from muse.cli import main
from muse.tokenizer import PAD_ID

COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
AGENTIC = ["--workload", "agentic", "--num-sessions", "2", "--turns", "3:3",
           "--system-tokens", "150", "--user-tokens", "30:60", "--tool-result-tokens", "20:80",
           "--output-tokens", "8:8", "--think-time", "0:0.2"]


def server_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {name: samples[name] for name in COUNTERS}


def bench(base_url: str, out: Path, run_id: str, *flags: str) -> dict[str, Any]:
    main(["bench", "serve", "--base-url", base_url, "--output-dir", str(out), "--run-id",
          run_id, "--no-progress", *flags])
    return json.loads((out / f"{flags[flags.index('--workload') + 1]}-{run_id}.json"
                       if "--workload" in flags else next(out.glob(f"*-{run_id}.json"))
                       ).read_text())


def run_and_check(base_url: str, out: Path, run_id: str, *flags: str) -> dict[str, Any]:
    """Run the benchmark, then hold its figures against the server's own counters."""
    before = server_counters(base_url)
    results = bench(base_url, out, run_id, *flags)
    after = server_counters(base_url)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    requests = results["requests"]
    assert requests and all(r["error"] is None for r in requests), \
        [r["error"] for r in requests if r["error"]]
    assert sum(r["prompt_tokens"] for r in requests) == delta["vllm:prompt_tokens_total"]
    assert sum(r["completion_tokens"] for r in requests) == \
        delta["vllm:generation_tokens_total"]
    for r in requests:
        assert r["completion_tokens"] == r["intended_output_tokens"]  # ignore_eos: exact
        # muse sends the usage in every chunk, one chunk per generated token.
        assert r["num_chunks"] == r["completion_tokens"]
        assert len(r["itl_s"]) == r["num_chunks"] - 1
        assert 0 < r["ttft_s"] < r["e2e_s"]
    summaries = results["summaries"]
    assert sum(s["input_tokens"] for s in summaries) == delta["vllm:prompt_tokens_total"]
    assert sum(s["output_tokens"] for s in summaries) == delta["vllm:generation_tokens_total"]
    for s in summaries:
        assert s["failed"] == 0 and s["total_tokens_per_s"] > 0
        assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
        assert s["ttft_ms"]["p99"] <= s["e2e_ms"]["p99"]
        assert s["per_user_tokens_per_s"]["p50"] > 0
    assert sum(s["prefix_cache"]["server_hits_tokens"] for s in summaries) == \
        delta["vllm:prefix_cache_hits_total"]
    assert sum(s["prefix_cache"]["server_queries_tokens"] for s in summaries) == \
        delta["vllm:prefix_cache_queries_total"]
    stem = out / f"{results['config']['workload']}-{run_id}"
    assert Path(f"{stem}.png").stat().st_size > 0
    assert Path(results["config"]["trace"]).exists()
    return results


def test_agentic_sessions_resend_their_history_and_hit_the_prefix_cache(
        muse_server: str, tmp_path: Path) -> None:
    results = run_and_check(muse_server, tmp_path, "agentic", *AGENTIC, "--concurrency", "2",
                            "--num-gpus", "2", "--slo-ttft-ms", "60000")
    (summary,) = results["summaries"]
    assert summary["num_requests"] == 6 and summary["concurrency"] == 2
    assert summary["prefix_cache"]["usage_hit_rate"] > 0
    assert summary["prefix_cache"]["server_hit_rate"] > 0
    assert summary["total_tokens_per_s_per_gpu"] == pytest.approx(
        summary["total_tokens_per_s"] / 2)
    assert summary["goodput"]["attainment"] == 1.0
    for session in ("s0000", "s0001"):
        turns = sorted((r for r in results["requests"] if r["session_id"] == session),
                       key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        for previous, current in itertools.pairwise(turns):
            # The whole conversation, the reply included, comes back with the next turn.
            assert current["prompt_tokens"] > previous["prompt_tokens"] + \
                previous["completion_tokens"]
            assert current["cached_tokens"] > 0
        for r in turns:
            assert abs(r["prompt_tokens"] - r["intended_input_tokens"]) <= \
                0.15 * r["intended_input_tokens"] + 16


def test_shared_prefix_sweep_reports_ttft_per_level_and_reuses_group_prefixes(
        muse_server: str, tmp_path: Path) -> None:
    results = run_and_check(muse_server, tmp_path, "shared", "--workload", "shared-prefix",
                            "--num-groups", "2", "--requests-per-group", "2",
                            "--input-tokens", "300", "--prefix-tokens", "240",
                            "--output-tokens", "4", "--concurrency", "1,2")
    assert [s["concurrency"] for s in results["summaries"]] == [1, 2]
    for summary in results["summaries"]:
        assert summary["num_requests"] == 4 and summary["ttft_ms"]["p90"] > 0
        assert summary["prefix_cache"]["usage_hit_rate"] > 0
        assert summary["prefix_cache"]["server_hit_rate"] > 0
    for r in results["requests"]:
        assert abs(r["prompt_tokens"] - 300) <= 32  # the chat template and the salt
        if r["session_id"].endswith("r000"):
            # A group's first request: groups share nothing, and the salt keeps the second
            # level from reusing the first level's prefixes.
            assert r["cached_tokens"] == 0
        elif r["level"] == 0:
            assert r["cached_tokens"] >= 240 - 32  # the group's prefix, to the block


def test_random_workload_on_completions_shares_no_prefix(muse_server: str, tmp_path: Path
                                                         ) -> None:
    results = run_and_check(muse_server, tmp_path, "random", "--workload", "random",
                            "--endpoint", "completions", "--num-requests", "4",
                            "--input-tokens", "50:150", "--output-tokens", "4:8",
                            "--concurrency", "2")
    assert len(results["requests"]) == 4
    assert all(r["cached_tokens"] == 0 for r in results["requests"])
    assert results["summaries"][0]["prefix_cache"]["usage_hit_rate"] == 0


def test_tokens_that_add_no_text_are_still_timed(muse_server: str, tmp_path: Path) -> None:
    # Forced to the hidden padding token, the replies have no text at all (as random weights
    # with a smaller tokenizer than the model's vocabulary nearly do).
    results = run_and_check(muse_server, tmp_path, "textless", "--workload", "random",
                            "--num-requests", "2", "--input-tokens", "50:60",
                            "--output-tokens", "6:6", "--concurrency", "2", "--extra-body",
                            json.dumps({"logit_bias": {str(PAD_ID): 100}}))
    assert all(r["ttft_s"] > 0 and len(r["itl_s"]) == 5 for r in results["requests"])
    assert results["summaries"][0]["itl_ms"]["p50"] > 0


def test_trace_generation_with_the_server_tokenizer_is_deterministic(
        muse_server: str, tmp_path: Path) -> None:
    flags = [*AGENTIC, "--seed", "5", "--trace-only"]
    bench_trace = []
    for name in ("a", "b"):
        main(["bench", "serve", "--base-url", muse_server, "--output-dir", str(tmp_path / name),
              "--run-id", "same", *flags])
        bench_trace.append((tmp_path / name / "agentic-same-trace.jsonl").read_text())
    assert bench_trace[0] == bench_trace[1]
    assert "server: " in bench_trace[0].splitlines()[0]
    assert not list((tmp_path / "a").glob("*.json"))  # --trace-only sends no request


def test_replaying_a_saved_trace_sends_identical_requests(muse_server: str, tmp_path: Path
                                                          ) -> None:
    flags = ["--assistant-history", "trace", "--concurrency", "2"]
    first = bench(muse_server, tmp_path / "first", "replay", *AGENTIC, "--turns", "2:2",
                  "--output-tokens", "4:4", *flags)
    again = bench(muse_server, tmp_path / "again", "replay", "--trace",
                  first["config"]["trace"], *flags)

    def sent(results: dict) -> list[tuple[str, int, str]]:
        return sorted((r["session_id"], r["turn"], r["body_sha256"]) for r in results["requests"])

    assert len(sent(first)) == 4
    assert sent(first) == sent(again)

"""`muse bench serve`: make or load a trace, replay it level by level, write JSON and a plot."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

import muse
from muse.bench.agentic import AgenticSettings, generate_agentic
from muse.bench.client import RequestOptions
from muse.bench.options import SessionsPerLevel, load_levels
from muse.bench.plot import plot_levels
from muse.bench.random_lengths import RandomSettings, generate_random
from muse.bench.results import results_document, write_results
from muse.bench.runner import Level, LevelRun, ReplayOptions, run_level
from muse.bench.server_metrics import prefix_cache_delta, server_counters, spec_decode_delta
from muse.bench.shared_prefix import SharedPrefixSettings, generate_shared_prefix
from muse.bench.summary import SLO, summarize
from muse.bench.tokens import CharsPerToken, Sizer, TokenCounter, server_tokenizer
from muse.bench.trace import Trace, load_trace, save_trace

logger = logging.getLogger("muse.bench")


@dataclasses.dataclass
class ServerInfo:
    model: str | None
    max_model_len: int | None


def discover(base_url: str, headers: dict[str, str], model: str | None) -> ServerInfo:
    """The model to request and its context length, from `/v1/models`."""
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if model is None:
        if not models:
            raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
        model = models[0]["id"]
    entry = next((m for m in models if m.get("id") == model), None)
    if entry is None:
        logger.warning("%s is not among the served models %s", model,
                       [m.get("id") for m in models])
    return ServerInfo(model, (entry or {}).get("max_model_len"))


def _override(settings: Any, values: dict[str, Any]) -> None:
    for name, value in values.items():
        if value is not None:
            setattr(settings, name, value)


def _single(span: tuple[int, int] | None, flag: str) -> int | None:
    if span is not None and span[0] != span[1]:
        raise ValueError(f"shared-prefix takes one {flag} value, got {span[0]}:{span[1]}")
    return None if span is None else span[0]


def generate_trace(args: argparse.Namespace, workload: str, counter: TokenCounter,
                   max_model_len: int | None, num_sessions: int) -> Trace:
    sizer = Sizer(counter)
    if workload == "agentic":
        agentic = AgenticSettings.for_context(max_model_len)
        _override(agentic, {"num_sessions": num_sessions, "system_tokens": args.system_tokens,
                            "user_tokens": args.user_tokens, "turns": args.turns,
                            "tool_result_tokens": args.tool_result_tokens,
                            "output_tokens": args.output_tokens,
                            "think_time_s": args.think_time,
                            "max_context_tokens": args.max_context})
        return generate_agentic(agentic, sizer, args.seed)
    if workload == "shared-prefix":
        shared = SharedPrefixSettings.for_context(max_model_len)
        _override(shared, {"num_groups": args.num_groups,
                           "requests_per_group": args.requests_per_group,
                           "input_tokens": _single(args.input_tokens, "--input-tokens"),
                           "prefix_tokens": args.prefix_tokens,
                           "output_tokens": _single(args.output_tokens, "--output-tokens")})
        shared.validate(max_model_len)
        return generate_shared_prefix(shared, sizer, args.seed)
    lengths = RandomSettings.for_context(max_model_len)
    _override(lengths, {"num_requests": args.num_requests, "input_tokens": args.input_tokens,
                        "output_tokens": args.output_tokens})
    lengths.validate(max_model_len)
    return generate_random(lengths, sizer, args.seed)


def format_summary(summary: dict[str, Any]) -> str:
    def stat(key: str, name: str) -> str:
        values = summary.get(key)
        if not values:
            return f"{name} -"
        return f"{name} p50/p90/p99 {values['p50']:.1f}/{values['p90']:.1f}/{values['p99']:.1f}"

    cache = summary["prefix_cache"]
    rates = [f"{name} {cache[key]:.3f}" for name, key in (("usage", "usage_hit_rate"),
                                                            ("server", "server_hit_rate"))
             if cache.get(key) is not None]
    goodput = summary["goodput"]
    lines = [
        (f"[{summary['label']}] {summary['completed']}/{summary['num_requests']} requests in "
         f"{summary['duration_s']:.1f} s, {summary['failed']} failed"),
        (f"  tokens/s: total {summary['total_tokens_per_s']:.1f} "
         f"({summary['total_tokens_per_s_per_gpu']:.1f} per GPU), output "
         f"{summary['output_tokens_per_s']:.1f}; input {summary['input_tokens']}, output "
         f"{summary['output_tokens']} tokens"),
        f"  {stat('ttft_ms', 'TTFT ms')}; {stat('itl_ms', 'ITL ms')}; {stat('e2e_ms', 'E2E ms')}",
        (f"  {stat('per_user_tokens_per_s', 'per-user tokens/s')}; prefix-cache hit rate: "
         f"{', '.join(rates) or '-'}"
         + (f"; goodput {goodput['requests_per_s']:.2f} req/s ({goodput['attainment']:.0%} "
            f"within SLO)" if goodput else "")),
    ]
    spec = summary.get("spec_decode")
    if spec is not None:
        rates = " ".join(f"{rate:.0%}" for rate in spec["accepted_per_position"])
        lines.append(f"  speculative: mean acceptance length {spec['mean_acceptance_length']:.2f}"
                     f" over {spec['num_drafts']:.0f} drafts; accepted per position {rates}")
    return "\n".join(lines + [f"  error: {e}" for e in summary["errors"]])


async def run_levels(args: argparse.Namespace, trace: Trace, levels: list[Level],
                     options: ReplayOptions, headers: dict[str, str], slo: SLO,
                     summaries: list[dict[str, Any]], runs: list[LevelRun],
                     level_finished: Callable[[], None]) -> None:
    """Run the levels in order, appending each one's summary and run as it finishes (so the
    caller holds them even if a later level is interrupted) and calling `level_finished`."""
    timeout = httpx.Timeout(args.request_timeout, connect=60.0)
    # No pool limit: the level's concurrency is the only cap on requests in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout,
                                 limits=limits) as http:
        for level in levels:
            before = await server_counters(http)
            run = await run_level(http, trace.sessions[:level.num_sessions], level, options)
            after = await server_counters(http)
            summary = summarize(run, args.num_gpus, slo, prefix_cache_delta(before, after),
                                spec_decode_delta(before, after))
            print(format_summary(summary), flush=True)
            summaries.append(summary)
            runs.append(run)
            level_finished()


def build_levels(spec: list[tuple[int | None, float | None]], per_level: SessionsPerLevel,
                 available: int) -> list[Level]:
    levels = []
    for index, (concurrency, rate) in enumerate(spec):
        count = per_level.for_level(concurrency, available)
        if concurrency is not None and rate is None and count < concurrency:
            logger.warning("concurrency %d runs only %d sessions (the trace holds %d)",
                           concurrency, count, available)
        levels.append(Level(index, concurrency, rate, count))
    return levels


def run_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """Run `muse bench serve`; returns the results (None with --trace-only)."""
    # One log line per request would bury the summaries.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    run_id = args.run_id or secrets.token_hex(4)
    if args.trace is None and args.workload is None:
        raise ValueError("give --workload (agentic, shared-prefix, random) or --trace FILE")
    if args.num_gpus < 1:
        raise ValueError("--num-gpus must be at least 1")
    try:
        server = discover(args.base_url, headers, args.model)
    except (httpx.HTTPError, ValueError) as error:
        if not (args.trace_only and args.chars_per_token):
            raise ValueError(f"cannot read {args.base_url}/v1/models: {error}") from None
        server = ServerInfo(args.model, None)

    trace = load_trace(Path(args.trace)) if args.trace else None
    workload = trace.workload if trace else args.workload
    levels_spec = load_levels(args, workload)
    per_level = args.sessions_per_level or (
        SessionsPerLevel(per_user=1) if workload == "agentic" else SessionsPerLevel())
    output_dir = Path(args.output_dir)
    stem = f"{workload}-{run_id}"
    if trace is None:
        counter = CharsPerToken(args.chars_per_token) if args.chars_per_token else \
            server_tokenizer(args.base_url, server.model, headers) or CharsPerToken()
        num_sessions = args.num_sessions or per_level.needed(
            [c for c, _ in levels_spec], AgenticSettings().num_sessions)
        started = time.monotonic()
        trace = generate_trace(args, workload, counter, server.max_model_len, num_sessions)
        trace_path = output_dir / f"{stem}-trace.jsonl"
        save_trace(trace, trace_path)
        logger.info("wrote %d sessions, %d requests (%s) to %s in %.1f s",
                    len(trace.sessions), trace.num_requests, counter.description, trace_path,
                    time.monotonic() - started)
    else:
        trace_path = Path(args.trace)
    if args.trace_only:
        return None

    levels = build_levels(levels_spec, per_level, len(trace.sessions))
    request = RequestOptions(server.model, args.endpoint, ignore_eos=args.ignore_eos,
                             extra_body=args.extra_body)
    options = ReplayOptions(request, args.assistant_history, run_id if args.salt else None,
                            args.seed, args.progress, args.progress_interval)
    slo = SLO(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    config = {
        "muse_version": muse.__version__, "run_id": run_id, "started": started,
        "base_url": args.base_url,
        "model": server.model, "max_model_len": server.max_model_len,
        "endpoint": args.endpoint, "workload": workload, "trace": str(trace_path),
        "trace_settings": trace.settings, "seed": trace.seed,
        "token_counter": trace.token_counter, "num_sessions": len(trace.sessions),
        "ignore_eos": args.ignore_eos, "extra_body": args.extra_body,
        "assistant_history": args.assistant_history, "salted": args.salt,
        "num_gpus": args.num_gpus, "slo": dataclasses.asdict(slo),
    }
    json_path = output_dir / f"{stem}.json"
    summaries: list[dict[str, Any]] = []
    runs: list[LevelRun] = []

    def save(status: str) -> dict[str, Any]:
        results = results_document(config, summaries, runs, status, len(levels))
        write_results(json_path, results)
        return results

    try:
        asyncio.run(run_levels(args, trace, levels, options, headers, slo, summaries, runs,
                               level_finished=lambda: save("running")))
        interrupted = False
    except KeyboardInterrupt:
        # Ctrl-C: the level in flight is dropped (its figures would be cut short); every
        # finished one is kept.
        interrupted = True
    results = save("interrupted" if interrupted else "complete")
    png_path = output_dir / f"{stem}.png"
    plotted = bool(summaries) and plot_levels(
        summaries, png_path, f"{workload} on {server.model} ({args.base_url}, "
                             f"{args.num_gpus} GPU)")
    print(f"results: {json_path}" + (f"\nplot: {png_path}" if plotted else "")
          + f"\ntrace: {trace_path}")
    if interrupted:
        print(f"interrupted: {len(summaries)} of {len(levels)} levels finished and are saved",
              file=sys.stderr)
        raise SystemExit(130)
    return results

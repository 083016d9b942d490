"""The `muse bench serve` flags, and parsing of their ranges and lists (no torch import)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

WORKLOADS = ("agentic", "shared-prefix", "random")
DEFAULT_CONCURRENCY = {"agentic": (1, 128), "shared-prefix": (1, 2, 4, 8, 16, 32, 64),
                       "random": (1, 16, 64)}


def int_range(text: str) -> tuple[int, int]:
    """`N` or `MIN:MAX`."""
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (integers), got {text!r}")


def float_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition(":")
    try:
        return float(low), float(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected X or MIN:MAX (seconds), got {text!r}")


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated rates or inf, got {text!r}")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected rates > 0 (or inf), got {text!r}")
    return values


@dataclass(frozen=True)
class SessionsPerLevel:
    """How many of the trace's sessions a level runs: all, a count, or a count per user."""

    count: int | None = None
    per_user: int | None = None

    @classmethod
    def parse(cls, text: str) -> SessionsPerLevel:
        try:
            if text == "all":
                return cls()
            if text.endswith("x"):
                value = cls(per_user=int(text[:-1]))
            else:
                value = cls(count=int(text))
        except ValueError:
            value = None
        if value is None or min(v for v in (value.count, value.per_user) if v is not None) < 1:
            raise argparse.ArgumentTypeError(f"expected `all`, N or Nx (N >= 1), got {text!r}")
        return value

    def for_level(self, concurrency: int | None, available: int) -> int:
        if self.count is not None:
            return min(self.count, available)
        if self.per_user is not None and concurrency is not None:
            return min(self.per_user * concurrency, available)
        return available

    def needed(self, concurrency_levels: list[int | None], fallback: int) -> int:
        """Sessions a generated trace should hold for every level to have its share."""
        if self.count is not None:
            return self.count
        if self.per_user is not None and None not in concurrency_levels:
            return self.per_user * max(concurrency_levels)
        return fallback


def extra_body(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object: {error}")
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server's root URL (without /v1)")
    target.add_argument("--model", default=None,
                        help="the model name to request (default: the server's first model)")
    target.add_argument("--api-key", default=None,
                        help="sent as `Authorization: Bearer KEY` (default: none)")
    target.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                        help="streaming chat completions, or completions of the joined texts")
    target.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="do not send `ignore_eos` (for servers that refuse it); replies "
                             "may then end before max_tokens (default: off)")
    target.add_argument("--extra-body", type=extra_body, default={},
                        help="JSON object merged into every request body")
    target.add_argument("--request-timeout", type=float, default=3600.0,
                        help="seconds before one request is abandoned")

    load = parser.add_argument_group("load")
    load.add_argument("--workload", choices=WORKLOADS, default=None,
                      help="generate this workload (default: none; give this or --trace)")
    load.add_argument("--trace", default=None,
                      help="replay this JSONL trace instead of generating one (default: none)")
    load.add_argument("--concurrency", type=int_list, default=None,
                      help="comma-separated numbers of simultaneous sessions, one level each "
                           "(default: agentic 1,128; shared-prefix 1,2,4,8,16,32,64; "
                           "random 1,16,64)")
    load.add_argument("--request-rate", type=rate_list, default=None,
                      help="comma-separated session arrival rates per second (Poisson), or "
                           "inf; instead of --concurrency (default: none)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="with --request-rate: at most this many sessions at once (default: "
                           "no cap)")
    load.add_argument("--sessions-per-level", type=SessionsPerLevel.parse, default=None,
                      help="sessions each level runs: all, N, or Nx (N per simulated user); "
                           "(default: 1x for agentic, all otherwise)")
    load.add_argument("--assistant-history", choices=["server", "trace"], default="server",
                      help="append the server's replies or the trace's scripted ones to the "
                           "conversation")
    load.add_argument("--run-id", default=None,
                      help="names the output files and salts the prompts (default: random)")
    load.add_argument("--no-salt", dest="salt", action="store_false",
                      help="do not prefix each level's prompts with the run id and level, so "
                           "levels may reuse each other's prefix cache (default: off)")
    load.add_argument("--seed", type=int, default=0, help="seeds the trace and the arrivals")

    report = parser.add_argument_group("report")
    report.add_argument("--num-gpus", type=int, default=1,
                        help="GPUs serving the model: per-GPU figures divide by this")
    report.add_argument("--slo-ttft-ms", type=float, default=None,
                        help="goodput counts requests with TTFT at most this (default: none)")
    report.add_argument("--slo-tpot-ms", type=float, default=None,
                        help="goodput counts requests with TPOT at most this (default: none)")
    report.add_argument("--slo-e2e-ms", type=float, default=None,
                        help="goodput counts requests with E2E latency at most this (default: "
                             "none)")
    report.add_argument("--output-dir", default="bench-results",
                        help="where the results JSON, the plot and the trace go")
    report.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar on a terminal, no progress lines elsewhere "
                             "(default: off)")
    report.add_argument("--progress-interval", type=float, default=30.0,
                        help="seconds between progress lines when stderr is not a terminal "
                             "(a bar is drawn on a terminal)")
    report.add_argument("--trace-only", action="store_true",
                        help="write the trace and stop without sending requests (default: off)")

    sizing = parser.add_argument_group("workload lengths (defaults scale to the server's "
                                       "context)")
    sizing.add_argument("--chars-per-token", type=float, default=None,
                        help="size text by this ratio instead of the server's /tokenize (default: "
                             "/tokenize where it answers, else 4)")
    sizing.add_argument("--num-sessions", type=int, default=None,
                        help="agentic: sessions in the trace (default: what the levels run)")
    sizing.add_argument("--system-tokens", type=int, default=None,
                        help="agentic: system prompt length (default: 6000)")
    sizing.add_argument("--user-tokens", type=int_range, default=None,
                        help="agentic: task length MIN:MAX (default: 200:1200)")
    sizing.add_argument("--turns", type=int_range, default=None,
                        help="agentic: requests per session MIN:MAX (default: 20:60)")
    sizing.add_argument("--tool-result-tokens", type=int_range, default=None,
                        help="agentic: tool result length MIN:MAX, log-uniform (default: "
                             "100:2500)")
    sizing.add_argument("--think-time", type=float_range, default=None,
                        help="agentic: seconds between a reply and the next request "
                             "MIN:MAX (default: 0.5:5)")
    sizing.add_argument("--max-context", type=int, default=None,
                        help="agentic: a session ends before its conversation passes this "
                             "(default: the server's max_model_len)")
    sizing.add_argument("--num-groups", type=int, default=None,
                        help="shared-prefix: groups (default: 8)")
    sizing.add_argument("--requests-per-group", type=int, default=None,
                        help="shared-prefix: requests per group (default: 8)")
    sizing.add_argument("--prefix-tokens", type=int, default=None,
                        help="shared-prefix: prefix shared in a group (default: 73360)")
    sizing.add_argument("--input-tokens", type=int_range, default=None,
                        help="tokens per request; shared-prefix N, random MIN:MAX (default: "
                             "shared-prefix 80000, random 256:4096)")
    sizing.add_argument("--output-tokens", type=int_range, default=None,
                        help="tokens per reply; agentic and random MIN:MAX, shared-prefix N "
                             "(default: agentic 30:400, shared-prefix 20, random 64:512)")
    sizing.add_argument("--num-requests", type=int, default=None,
                        help="random: requests (default: 256)")


def load_levels(args: argparse.Namespace, workload: str) -> list[tuple[int | None, float | None]]:
    """(concurrency, request rate) per level, from the flags or the workload's defaults."""
    if args.request_rate is not None:
        if args.concurrency is not None:
            raise ValueError("give --concurrency or --request-rate, not both")
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError("--max-concurrency must be at least 1")
        return [(args.max_concurrency, r) for r in args.request_rate]
    if args.max_concurrency is not None:
        raise ValueError("--max-concurrency goes with --request-rate")
    return [(c, None) for c in args.concurrency or DEFAULT_CONCURRENCY.get(workload, (1,))]

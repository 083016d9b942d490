"""Per-level figures from request records: latency percentiles, throughput, goodput.

Token counts are the server's own (`usage` of each response). Definitions are in
docs/benchmarking.md; in short:
- TTFT: request sent -> first chunk carrying output; E2E: request sent -> end of the stream.
- ITL: gaps between consecutive output chunks; TPOT: (E2E - TTFT) / (output tokens - 1).
- per-user tokens/s: a request's decode speed, (output tokens - 1) / (E2E - TTFT) = 1 / TPOT.
- total tokens/s: (input + output tokens of completed requests) / level duration; per GPU:
  divided by --num-gpus.
- goodput: completed requests meeting every SLO given, per second of the level.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from muse.bench.runner import LevelRun, RequestRecord

PERCENTILES = (50, 90, 99)


@dataclass
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met_by(self, record: RequestRecord) -> bool:
        tpot = tpot_s(record)
        return ((self.ttft_ms is None or (record.ttft_s is not None
                                          and record.ttft_s * 1e3 <= self.ttft_ms))
                and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)
                and (self.e2e_ms is None or record.e2e_s * 1e3 <= self.e2e_ms))


def tpot_s(record: RequestRecord) -> float | None:
    """Time per output token after the first; None for one-token replies."""
    if record.ttft_s is None or not record.completion_tokens or record.completion_tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (record.completion_tokens - 1)


def per_user_tokens_per_s(record: RequestRecord) -> float | None:
    tpot = tpot_s(record)
    return 1.0 / tpot if tpot else None


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float] | None:
    """Mean and percentiles (linear interpolation), times `scale` (1e3 for ms)."""
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64) * scale
    stats = {"mean": float(array.mean())}
    stats.update({f"p{p}": float(np.percentile(array, p)) for p in PERCENTILES})
    return stats


def summarize(run: LevelRun, num_gpus: int, slo: SLO,
              server_prefix_cache: dict[str, float] | None,
              spec_decode: dict[str, Any] | None = None) -> dict[str, Any]:
    done = [r for r in run.records if r.ok]
    duration = run.duration_s or float("nan")
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.completion_tokens or 0 for r in done)
    cached = [r.cached_tokens for r in done]
    usage_cached = sum(cached) if done and all(c is not None for c in cached) else None
    total_per_s = (input_tokens + output_tokens) / duration
    level = run.level
    summary: dict[str, Any] = {
        "level": level.index, "label": level.label, "concurrency": level.concurrency,
        # JSON has no infinity: "inf" stands for all sessions at once.
        "request_rate": level.request_rate if level.request_rate is None
        or math.isfinite(level.request_rate) else "inf",
        "num_sessions": level.num_sessions,
        "num_requests": len(run.records), "completed": len(done),
        "failed": len(run.records) - len(done), "duration_s": run.duration_s,
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "cached_tokens": usage_cached,
        "request_throughput": len(done) / duration,
        "input_tokens_per_s": input_tokens / duration,
        "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": total_per_s,
        "num_gpus": num_gpus,
        "total_tokens_per_s_per_gpu": total_per_s / num_gpus,
        "output_tokens_per_s_per_gpu": output_tokens / duration / num_gpus,
        "ttft_ms": distribution([r.ttft_s for r in done if r.ttft_s is not None], 1e3),
        "tpot_ms": distribution([t for r in done if (t := tpot_s(r)) is not None], 1e3),
        "itl_ms": distribution([gap for r in done for gap in r.itl_s], 1e3),
        "e2e_ms": distribution([r.e2e_s for r in done], 1e3),
        "per_user_tokens_per_s": distribution(
            [v for r in done if (v := per_user_tokens_per_s(r)) is not None]),
        "prefix_cache": {
            "usage_hit_rate": usage_cached / input_tokens
            if usage_cached is not None and input_tokens else None,
            **(server_prefix_cache or {"server_hit_rate": None})},
        # The server's speculative-decoding counters over the level (None: it has none).
        "spec_decode": spec_decode,
        "errors": sorted({r.error for r in run.records if r.error})[:5],
    }
    if slo.is_set:
        good = sum(slo.met_by(r) for r in done)
        summary["goodput"] = {"slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms,
                                      "e2e_ms": slo.e2e_ms},
                              "requests_per_s": good / duration,
                              "attainment": good / len(run.records) if run.records else None}
    else:
        summary["goodput"] = None
    return summary

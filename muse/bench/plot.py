"""The PNG of a run: throughput and latency against concurrency (or request rate)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from muse.plot_png import save_figure

logger = logging.getLogger("muse.bench")


def _series(summaries: list[dict], key: str, stat: str) -> list[float]:
    return [float("nan") if s.get(key) is None else s[key][stat] for s in summaries]


def plot_levels(summaries: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Four panels: tokens/s per GPU, per-user tokens/s, TTFT and ITL percentiles.

    Returns False, writing nothing, where matplotlib is missing: the plot is a report, and
    the JSON results hold every figure in it.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plot (pip install matplotlib)")
        return False
    by_rate = summaries[0]["request_rate"] is not None
    # An infinite rate ("inf") has no place on the axis.
    x = [(float("nan") if s["request_rate"] == "inf" else s["request_rate"]) if by_rate
         else s["concurrency"] for s in summaries]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    throughput, per_user, ttft, itl = axes.flat
    throughput.plot(x, [s["total_tokens_per_s_per_gpu"] for s in summaries], "o-",
                    label="total (input + output)")
    throughput.plot(x, [s["output_tokens_per_s_per_gpu"] for s in summaries], "s-",
                    label="output")
    throughput.set_ylabel("tokens/s per GPU")
    for stat in ("p50", "p90"):
        per_user.plot(x, _series(summaries, "per_user_tokens_per_s", stat), "o-", label=stat)
    per_user.set_ylabel("per-user tokens/s (1 / TPOT)")
    for panel, key, name in ((ttft, "ttft_ms", "TTFT (ms)"), (itl, "itl_ms", "ITL (ms)")):
        for stat in ("p50", "p90", "p99"):
            panel.plot(x, _series(summaries, key, stat), "o-", label=stat)
        panel.set_ylabel(name)
    positive = all(0 < v < float("inf") for v in x)
    for panel in axes.flat:
        if positive and len(x) > 1 and max(x) / min(x) >= 8:
            panel.set_xscale("log", base=2)
        if positive:
            panel.set_xticks(x, [f"{v:g}" for v in x])
            panel.minorticks_off()
        panel.set_xlabel("request rate (sessions/s)" if by_rate else "concurrency")
        panel.grid(True, which="both", alpha=0.3)
        panel.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(figure, path, dpi=110)
    plt.close(figure)
    return True

"""Progress of one load level: a tqdm bar on a terminal, a log line every few seconds in a
log (where a bar's redraws would be noise and a long level would otherwise say nothing)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

from tqdm import tqdm

logger = logging.getLogger("muse.bench")


class LevelProgress:
    """Requests finished out of a level's total, and the output tokens/s they add up to."""

    def __init__(self, label: str, total: int, enabled: bool, interval_s: float) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.output_tokens = 0
        self.started = time.perf_counter()
        terminal = sys.stderr.isatty()
        self.bar = tqdm(total=total, desc=label, unit="req", dynamic_ncols=True) \
            if enabled and terminal else None
        # Lines only where there is no bar; None: no lines.
        self.interval_s = interval_s if enabled and not terminal and interval_s > 0 else None

    def update(self, requests: int = 1, output_tokens: int = 0) -> None:
        self.done += requests
        self.output_tokens += output_tokens
        if self.bar is not None:
            self.bar.update(requests)

    def line(self) -> str:
        elapsed = time.perf_counter() - self.started
        rate = self.output_tokens / elapsed if elapsed > 0 else 0.0
        return (f"[{self.label}] {self.done}/{self.total} requests, {elapsed:.0f} s, "
                f"{rate:.1f} output tokens/s")

    async def report(self) -> None:
        """Log a line every interval until cancelled (when the level ends)."""
        if self.interval_s is None:
            return
        while True:
            await asyncio.sleep(self.interval_s)
            logger.info(self.line())

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

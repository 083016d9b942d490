"""The results JSON of `muse bench serve`: rewritten after every level, so a run that is
interrupted (Ctrl-C, a lost connection, a killed job) keeps every level that finished."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from muse.bench.runner import LevelRun

# "running": levels are still to come; "complete": every level ran; "interrupted": the run
# was stopped and the file holds the levels that finished before.
STATUSES = ("running", "complete", "interrupted")


def results_document(config: dict[str, Any], summaries: list[dict[str, Any]],
                     runs: list[LevelRun], status: str, num_levels: int) -> dict[str, Any]:
    if status not in STATUSES:
        raise ValueError(f"status must be one of {STATUSES}, got {status!r}")
    return {"config": config, "status": status, "levels_finished": len(summaries),
            "levels_planned": num_levels, "summaries": summaries,
            "requests": [dataclasses.asdict(r) for run in runs for r in run.records]}


def write_results(path: Path, results: dict[str, Any]) -> None:
    """Write through a temporary file, so an interruption mid-write never leaves a file cut
    short in place of the previous level's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=1))
    os.replace(partial, path)

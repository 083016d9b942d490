"""What a run leaves behind: its environment, the JSON record (merged with an earlier run's),
and the console table."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.shapes import describe_transformers_side, text_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "python": platform.python_version(),
        # MUSE_COMMIT names the commit where the checkout's own history is not at hand (a copy
        # of the working tree on another machine).
        "git_commit": os.environ.get("MUSE_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def write_json(path: str | os.PathLike | None, data: dict[str, Any]) -> None:
    """Write (atomically) so a run stopped half-way leaves the last complete record."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def merge_previous(record: dict[str, Any], path: str | None, engines: Sequence[str],
                   must_match: Sequence[str] = ()) -> None:
    """Take the results of engines not run now from an earlier run's JSON (same benchmark
    and shape), so engines can run in separate commands and still be compared."""
    if not path:
        return
    previous = json.loads(Path(path).read_text())
    for key in ("benchmark",):
        if previous.get(key) != record[key]:
            raise SystemExit(f"--merge-from {path}: a {previous.get(key)} record, not "
                             f"{record[key]}")
    if previous["shape"]["name"] != record["shape"]["name"]:
        raise SystemExit(f"--merge-from {path}: shape {previous['shape']['name']}, not "
                         f"{record['shape']['name']}")
    for key in must_match:
        if previous.get(key) != json.loads(json.dumps(record[key], default=str)):
            raise SystemExit(f"--merge-from {path}: its {key} differs from this run's")
    for engine, result in previous["results"].items():
        if engine not in engines:
            record["results"][engine] = result
            record.setdefault("merged_from", {})[engine] = {
                "path": str(path), "environment": previous.get("environment"),
                "config": previous.get("config")}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(headers, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 500 else text[:500] + "..."


def header(kind: str, args: argparse.Namespace, env: dict[str, Any]) -> str:
    text = text_config(args.shape)
    side = describe_transformers_side(text)
    where = env["gpu"] or f"CPU ({env['cpu']})"
    lines = [f"{kind}: {args.shape} ({args.dtype}) on {where}, commit {env['git_commit']}"]
    if "transformers" in args.engines and side["stand_in"]:
        lines.append(f"  {side['stand_in']}: " + "; ".join(side["differences"]))
    return "\n".join(lines)

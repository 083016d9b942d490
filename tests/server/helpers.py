"""Small helpers shared by the live-server tests: metrics, polling, processes, tools."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

POLL_INTERVAL_S = 0.2


def read_metrics(base_url: str, api_key: str | None = None) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (sample name, sorted labels)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(f"{base_url}/metrics", timeout=30, headers=headers)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (e.g. any model_name)."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and wanted <= set(sample_labels))


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `condition` until it holds; fail naming `what` if it never does in `timeout_s`.

    A bound on an eventually-true condition, not a measurement: it only fails on a hang.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(POLL_INTERVAL_S)


def engine_idle(base_url: str, api_key: str | None = None) -> bool:
    samples = read_metrics(base_url, api_key)
    return (metric(samples, "vllm:num_requests_running") == 0
            and metric(samples, "vllm:num_requests_waiting") == 0
            and metric(samples, "muse_kv_cache_blocks_used") == 0)


def child_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
    return sorted(set(children))


def engine_core_pid(server_pid: int) -> int:
    """The engine core: the server's child started by multiprocessing's spawn."""
    found = []
    for child in child_pids(server_pid):
        try:
            command = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        except FileNotFoundError:
            continue
        if b"spawn_main" in command:
            found.append(child)
    assert len(found) == 1, f"expected one engine core process under {server_pid}, got {found}"
    return found[0]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}

TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}

TOOLS = [WEATHER_TOOL, TIME_TOOL]
TOOL_SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

"""Workload traces: sessions of turns, saved as JSONL so a run can be repeated exactly.

Line 1 is an optional header, every other line one session:

    {"type": "header", "version": 1, "workload": "agentic", "seed": 0, "settings": {...},
     "token_counter": "server: http://.../tokenize"}
    {"type": "session", "id": "s0000", "turns": [
        {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."}],
         "output_tokens": 120, "delay_s": 0.0, "assistant": "...", "intended_input_tokens": 6400},
        {"messages": [{"role": "user", "content": "EXECUTION RESULT ..."}], "output_tokens": 80,
         "delay_s": 2.5}]}

A turn's `messages` are appended to the conversation before its request is sent; the reply
is appended after it. Single-request workloads are sessions of one turn.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TRACE_VERSION = 1


@dataclass
class Turn:
    messages: list[dict[str, Any]]
    output_tokens: int  # the request's max_tokens; the exact length when the server ignores EOS
    delay_s: float = 0.0  # think and tool time before this request is sent
    assistant: str | None = None  # a scripted reply, for replays independent of the server
    intended_input_tokens: int | None = None  # the whole prompt's intended length

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Session:
    id: str
    turns: list[Turn]
    group: str | None = None  # e.g. the shared-prefix group

    @property
    def num_requests(self) -> int:
        return len(self.turns)


@dataclass
class Trace:
    workload: str
    sessions: list[Session]
    seed: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    token_counter: str | None = None

    def __post_init__(self) -> None:
        # Held as JSON gives it back (tuples become lists), so a loaded trace equals the
        # trace that was saved.
        self.settings = json.loads(json.dumps(self.settings))

    @property
    def num_requests(self) -> int:
        return sum(s.num_requests for s in self.sessions)


def save_trace(trace: Trace, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    header = {"type": "header", "version": TRACE_VERSION, "workload": trace.workload,
              "seed": trace.seed, "settings": trace.settings,
              "token_counter": trace.token_counter}
    with open(path, "w") as out:
        out.write(json.dumps(header, ensure_ascii=False) + "\n")
        for session in trace.sessions:
            line = {"type": "session", "id": session.id,
                    **({"group": session.group} if session.group is not None else {}),
                    "turns": [turn.to_json() for turn in session.turns]}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")


class TraceError(ValueError):
    pass


def _turn(raw: Any, where: str) -> Turn:
    if not isinstance(raw, dict):
        raise TraceError(f"{where} must be an object")
    messages = raw.get("messages")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise TraceError(f"{where}.messages must be a list of objects with a `role`")
    output_tokens = raw.get("output_tokens")
    if not isinstance(output_tokens, int) or output_tokens < 1:
        raise TraceError(f"{where}.output_tokens must be a positive integer")
    delay_s = raw.get("delay_s", 0.0)
    if not isinstance(delay_s, (int, float)) or delay_s < 0:
        raise TraceError(f"{where}.delay_s must be a number >= 0")
    assistant = raw.get("assistant")
    if assistant is not None and not isinstance(assistant, str):
        raise TraceError(f"{where}.assistant must be a string")
    return Turn(messages, output_tokens, float(delay_s), assistant,
                raw.get("intended_input_tokens"))


def load_trace(path: Path) -> Trace:
    """Read a trace written by `save_trace`, or a user's trace of the same shape."""
    trace = Trace(workload="replay", sessions=[])
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise TraceError(f"{where}: not JSON ({error})") from None
            if raw.get("type") == "header":
                trace.workload = raw.get("workload", trace.workload)
                trace.seed = raw.get("seed")
                trace.settings = raw.get("settings") or {}
                trace.token_counter = raw.get("token_counter")
                continue
            turns = raw.get("turns")
            if not isinstance(turns, list) or not turns:
                raise TraceError(f"{where}: `turns` must be a non-empty list")
            trace.sessions.append(Session(
                id=str(raw.get("id", f"s{len(trace.sessions):04}")),
                turns=[_turn(t, f"{where}: turns[{i}]") for i, t in enumerate(turns)],
                group=raw.get("group")))
    if not trace.sessions:
        raise TraceError(f"{path} holds no sessions")
    return trace

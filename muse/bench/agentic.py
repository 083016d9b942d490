"""The agentic workload: synthetic sessions of a coding agent in the style of OpenHands.

Every session starts from the same long system prompt (instructions and tool schemas) and a
task, then alternates assistant tool calls and tool results (file views, command output,
diffs). Every request resends the whole conversation, so consecutive requests of a session
share all but their newest messages, and all sessions share the system prompt. Tool results
come back as user messages in OpenHands' text form ("EXECUTION RESULT of [tool]:"), which any
chat template accepts.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from muse.bench.text import (
    TOOL_RESULT_SOURCES,
    TextSource,
    prose,
    system_prompt,
    task_description,
    tool_call,
)
from muse.bench.tokens import Sizer
from muse.bench.trace import Session, Trace, Turn

# Tokens a chat template adds around one message (role markers, separators), an allowance.
MESSAGE_OVERHEAD_TOKENS = 8
# The default lengths assume at least this context; a shorter context scales them down.
REFERENCE_CONTEXT = 32768
# How often an agent calls each tool mid-session.
TOOL_WEIGHTS = {"execute_bash": 0.45, "str_replace_editor": 0.4, "execute_ipython_cell": 0.08,
                "think": 0.07}


@dataclass
class AgenticSettings:
    num_sessions: int = 8
    system_tokens: int = 6000
    user_tokens: tuple[int, int] = (200, 1200)
    turns: tuple[int, int] = (20, 60)
    tool_result_tokens: tuple[int, int] = (100, 2500)
    output_tokens: tuple[int, int] = (30, 400)
    think_time_s: tuple[float, float] = (0.5, 5.0)
    # A session ends before its conversation would grow past this (the server's context).
    max_context_tokens: int | None = None

    @classmethod
    def for_context(cls, max_model_len: int | None) -> AgenticSettings:
        settings = cls(max_context_tokens=max_model_len)
        if max_model_len is None or max_model_len >= REFERENCE_CONTEXT:
            return settings
        scale = max_model_len / REFERENCE_CONTEXT

        def scaled(span: tuple[int, int]) -> tuple[int, int]:
            return max(1, round(span[0] * scale)), max(1, round(span[1] * scale))

        settings.system_tokens = max(1, round(settings.system_tokens * scale))
        settings.user_tokens = scaled(settings.user_tokens)
        settings.tool_result_tokens = scaled(settings.tool_result_tokens)
        settings.output_tokens = scaled(settings.output_tokens)
        return settings

    def validate(self) -> None:
        if self.num_sessions < 1:
            raise ValueError("--num-sessions must be at least 1")
        for name in ("user_tokens", "turns", "tool_result_tokens", "output_tokens",
                     "think_time_s"):
            low, high = getattr(self, name)
            if not 0 <= low <= high or (name != "think_time_s" and low < 1):
                flag = "--think-time" if name == "think_time_s" else "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a range MIN:MAX with 1 <= MIN <= MAX "
                                 f"(0 <= MIN for --think-time), got {low}:{high}")
        if self.system_tokens < 1:
            raise ValueError("--system-tokens must be at least 1")
        first_turn = (self.system_tokens + self.user_tokens[1] + self.output_tokens[1]
                      + 3 * MESSAGE_OVERHEAD_TOKENS)
        if self.max_context_tokens is not None and first_turn > self.max_context_tokens:
            raise ValueError(f"a first turn of --system-tokens {self.system_tokens} + "
                             f"--user-tokens up to {self.user_tokens[1]} + --output-tokens up "
                             f"to {self.output_tokens[1]} does not fit the context of "
                             f"{self.max_context_tokens} tokens")


def log_uniform(rng: random.Random, span: tuple[int, int]) -> int:
    """Short results are common and long ones rare, as in real agent logs."""
    low, high = span
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _result_source(rng: random.Random, tool: str) -> TextSource:
    if tool == "str_replace_editor":
        return TOOL_RESULT_SOURCES["file" if rng.random() < 0.7 else "diff"]
    if tool == "think":
        return prose
    return TOOL_RESULT_SOURCES["command"]


def _assistant(sizer: Sizer, rng: random.Random, seed: str, num_tokens: int) -> tuple[str, str]:
    """A scripted reply: some reasoning, then one tool call; returns (tool, text)."""
    tool = rng.choices(list(TOOL_WEIGHTS), weights=list(TOOL_WEIGHTS.values()))[0]
    return tool, sizer.fit(prose, seed, num_tokens, tail="\n\n" + tool_call(rng, tool))


def _session(settings: AgenticSettings, sizer: Sizer, system: str, seed: int, index: int
             ) -> Session:
    base = f"{seed}:session:{index}"
    rng = random.Random(base)
    num_turns = rng.randint(*settings.turns)
    user_tokens = rng.randint(*settings.user_tokens)
    task = sizer.fit(task_description, f"{base}:task", user_tokens)
    context = settings.max_context_tokens
    history = settings.system_tokens + user_tokens + 2 * MESSAGE_OVERHEAD_TOKENS
    turns: list[Turn] = []
    messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
    delay = 0.0
    for number in range(num_turns):
        output_tokens = rng.randint(*settings.output_tokens)
        if context is not None and history + output_tokens + MESSAGE_OVERHEAD_TOKENS > context:
            break
        tool, reply = _assistant(sizer, rng, f"{base}:turn:{number}:assistant", output_tokens)
        turns.append(Turn(messages, output_tokens, round(delay, 3), reply, history))
        history += output_tokens + MESSAGE_OVERHEAD_TOKENS
        result_tokens = log_uniform(rng, settings.tool_result_tokens)
        result = sizer.fit(_result_source(rng, tool), f"{base}:turn:{number}:result",
                           result_tokens)
        messages = [{"role": "user", "content": f"EXECUTION RESULT of [{tool}]:\n{result}"}]
        history += result_tokens + MESSAGE_OVERHEAD_TOKENS
        delay = rng.uniform(*settings.think_time_s)
    return Session(f"s{index:04}", turns)


def generate_agentic(settings: AgenticSettings, sizer: Sizer, seed: int) -> Trace:
    """`settings.num_sessions` sessions, made in order from (seed, session index): a larger
    trace begins with the sessions of a smaller one."""
    settings.validate()
    system = sizer.fit(system_prompt, f"{seed}:system", settings.system_tokens)
    sessions = [_session(settings, sizer, system, seed, i) for i in range(settings.num_sessions)]
    return Trace("agentic", sessions, seed, asdict(settings), sizer.counter.description)

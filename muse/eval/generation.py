"""Greedy chat replies through the engine (`muse.LLM`), one batch for a whole section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from muse.engine.sampling_params import SamplingParams
from muse.engine.structured_output import strict_tool_calls, without_strict
from muse.eval.progress import progress_bars
from muse.eval.replies import Reply, read_reply
from muse.llm import LLM


@dataclass
class ChatPrompt:
    """A conversation to continue with one assistant reply of at most `max_tokens`."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int = 256


@dataclass
class SectionResult:
    """A section's metrics, every reply it generated, and a few replies to show."""

    metrics: dict[str, Any]
    replies: list[Reply]
    examples: list[dict[str, Any]] = field(default_factory=list)


def reply_budget(llm: LLM, expected: dict[str, Any], cap: int) -> int:
    """Tokens allowed for a reply whose right version is the assistant message `expected`:
    twice its length plus a margin, so a model that never stops costs bounded time, and
    never more than `cap`."""
    # Rendered alone the message is <|bos|><|assistant|>{reply through <|end|>}\n.
    length = len(llm.tokenizer.apply_chat_template([expected], tokenize=True)) - 3
    return min(cap, 2 * length + 16)


def strict(tools: list[dict[str, Any]], on: bool = True) -> list[dict[str, Any]]:
    """The tool entries with every function marked `"strict": true` (when `on`), as a client
    asking for schema-following calls sends them."""
    if not on:
        return tools
    return [{**tool, "function": {**tool["function"], "strict": True}} for tool in tools]


def generate_replies(llm: LLM, prompts: list[ChatPrompt], label: str,
                     progress: bool | None = None) -> list[Reply]:
    """Greedy replies, with a progress bar labelled `label` (see `progress_bars`). Strict
    functions among a prompt's tools have their calls checked as they are written, as the
    server does under `tool_choice` "auto"."""
    if not prompts:
        return []
    token_prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        prompt.messages, tools=without_strict(prompt.tools), add_generation_prompt=True,
        tokenize=True)} for prompt in prompts]
    params = []
    for prompt in prompts:
        constraint = strict_tool_calls(prompt.tools, parallel=True)
        params.append(SamplingParams(
            temperature=0.0, max_tokens=prompt.max_tokens, skip_special_tokens=False,
            structured_output=constraint and constraint.after_reasoning()))
    outputs = llm.generate(token_prompts, params, use_tqdm=progress_bars(progress, label))
    return [read_reply(output.outputs[0], llm.tokenizer) for output in outputs]


def example(prompt: ChatPrompt, reply: Reply, expected: str, ok: bool) -> dict[str, Any]:
    return {"prompt": prompt.messages[-1]["content"], "reply": reply.text,
            "expected": expected, "ok": ok}

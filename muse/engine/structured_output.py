"""What a constrained request's output must match: JSON, JSON Schema, a regular expression, an
EBNF grammar, one of a list of strings, or tool calls.

The spec travels inside SamplingParams from the front end to the engine, so it holds only JSON
text and plain values. Its size and nesting depth are checked where it is built (a 400 before
anything is queued) and again at admission against the engine's limits; the engine compiles it
off its loop (`grammar_jobs.py`) and gives each sample a matcher (`grammar_matcher.py`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Literal

from muse.chat_format import THINK_END_ID, THINK_START_ID
from muse.engine.errors import InvalidRequestError

# With parallel tool calls a forced reply may hold this many calls.
MAX_FORCED_TOOL_CALLS = 4
# JSON text of a schema (or of all tools together); the engine's limit is
# `EngineArgs.max_grammar_bytes`, which defaults to this.
DEFAULT_MAX_GRAMMAR_BYTES = 2**20  # a 30k-value enum is about 300 KB
# Nesting of objects and arrays in a schema document. Real schemas stay far below; deeper
# ones only cost compile time (400 levels: 13 s) and, past Python's limit, a RecursionError.
MAX_SCHEMA_DEPTH = 64

_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]")


class StructuredOutputError(InvalidRequestError):
    """A constraint the engine cannot serve; `status` is the HTTP status the server answers
    with (400, or 503 when the compiler is too busy to start it in time)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message, param=param)
        self.status = status


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match.

    kind "json": any JSON object; "json_schema": `schema`; "regex": the regular expression
    `schema`; "grammar": the EBNF grammar `schema` (xgrammar's, GBNF-like, from `root`);
    "choice": one of the strings of the JSON list `schema`; "tool_calls": calls to `tools`
    (OpenAI function definitions) in the chat format `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`. When `forced`, the reply is one call (or up to MAX_FORCED_TOOL_CALLS
    when `parallel`) and nothing else (`tool_choice` "required" or named). Otherwise (strict
    functions under `tool_choice` "auto") the reply is free text until it opens a call with
    `<tool_call>`; the call must then name an offered function and give arguments that fit
    the schema of a function marked `"strict": true` (any JSON object for the others), and
    the text after it is free again; without `parallel` the first call ends the reply.

    `reasoning_start_token_id` / `reasoning_end_token_id`: a reply that opens with the start
    token holds a reasoning block, which the end token closes; the constraint applies from the
    token after it (from the first token when the reply opens otherwise, or when the prompt
    already ends with the end token, as when thinking is disabled).
    """

    kind: Literal["json", "json_schema", "regex", "grammar", "choice", "tool_calls"]
    schema: str | None = None  # text, so the spec stays hashable for the compile cache
    tools: tuple[str, ...] = field(default_factory=tuple)  # JSON text of each function
    parallel: bool = False
    forced: bool = True
    reasoning_start_token_id: int | None = None
    reasoning_end_token_id: int | None = None
    # The request field it came from, when not the kind's usual one (`field_name`).
    param: str | None = None

    @property
    def field_name(self) -> str:
        """The request field a problem with this constraint is reported against."""
        if self.param is not None:
            return self.param
        if self.kind == "tool_calls":
            return "tools"
        return "response_format" if self.kind in ("json", "json_schema") \
            else "structured_outputs"

    @property
    def grammar_key(self) -> StructuredOutput:
        """What the compiled grammar depends on: the reasoning gate is per request."""
        return dataclasses.replace(self, reasoning_start_token_id=None,
                                   reasoning_end_token_id=None)

    def after_reasoning(self) -> StructuredOutput:
        """This constraint, applied after the reply's `<think>` block (vLLM's behaviour with a
        reasoning parser)."""
        return dataclasses.replace(self, reasoning_start_token_id=THINK_START_ID,
                                   reasoning_end_token_id=THINK_END_ID)

    def check(self, max_bytes: int) -> None:
        """Size and depth limits, from the JSON text alone (no parsing, no recursion)."""
        texts = [self.schema] if self.schema is not None else list(self.tools)
        _check_size(sum(len(t.encode()) for t in texts), max_bytes, self.field_name)
        if self.kind in ("json_schema", "tool_calls"):
            for text in texts:
                _check_depth(json_text_depth(text), self.field_name)

    @staticmethod
    def for_schema(schema: dict[str, Any], max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                   param: str | None = None) -> StructuredOutput:
        field_name = param or "response_format"
        _check_depth(nesting_depth(schema, MAX_SCHEMA_DEPTH), field_name)
        # Keys keep the request's order: a schema's properties are written in their declared
        # order (as OpenAI's structured outputs do), so sorting them would change the output.
        text = json.dumps(bounded_strings_as_patterns(schema))
        _check_size(len(text.encode()), max_bytes, field_name)
        return StructuredOutput("json_schema", schema=text, param=param)

    @staticmethod
    def for_text(kind: Literal["regex", "grammar"], text: str,
                 max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                 param: str | None = None) -> StructuredOutput:
        """A regular expression or an EBNF grammar the whole output must match."""
        spec = StructuredOutput(kind, schema=text, param=param)
        if not text:
            raise StructuredOutputError(f"`{spec.field_name}` is empty", param=spec.field_name)
        spec.check(max_bytes)
        return spec

    @staticmethod
    def for_choice(choices: list[str], max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
                   param: str | None = None) -> StructuredOutput:
        """The output is exactly one of `choices` (non-empty strings)."""
        spec = StructuredOutput("choice", schema=json.dumps(list(choices)), param=param)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError(f"`{spec.field_name}` must be a list of non-empty "
                                        "strings", param=spec.field_name)
        spec.check(max_bytes)
        return spec

    @staticmethod
    def for_tools(functions: list[dict[str, Any]], parallel: bool,
                  max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES, forced: bool = True
                  ) -> StructuredOutput:
        for function in functions:
            _check_depth(nesting_depth(function, MAX_SCHEMA_DEPTH), "tools")
        texts = tuple(json.dumps(f) for f in functions)  # in order, as a schema's above
        _check_size(sum(len(t.encode()) for t in texts), max_bytes, "tools")
        return StructuredOutput("tool_calls", tools=texts, parallel=parallel, forced=forced)


def is_strict(function: dict[str, Any]) -> bool:
    """Whether an OpenAI function definition asks for schema-following arguments."""
    return function.get("strict") is True


def strict_tool_calls(tools: list[dict[str, Any]] | None, parallel: bool,
                      max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES) -> StructuredOutput | None:
    """The constraint of `tool_choice` "auto" over `tools` (OpenAI tool entries): calls
    checked as they are written when any function is `"strict": true` (as SGLang does), else
    None (the reply is unconstrained)."""
    functions = [tool["function"] for tool in tools or []]
    if not any(is_strict(function) for function in functions):
        return None
    return StructuredOutput.for_tools(functions, parallel, max_bytes, forced=False)


def without_strict(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template shows them: `strict` is a decoding switch, not
    something the model reads (prompts stay those of the same tools without it)."""
    if tools is None:
        return None
    return [{**tool, "function": {key: value for key, value in tool["function"].items()
                                  if key != "strict"}} if "function" in tool else tool
            for tool in tools]


def _check_size(num_bytes: int, max_bytes: int, field_name: str) -> None:
    if num_bytes > max_bytes:
        raise StructuredOutputError(
            f"`{field_name}` is too large to compile: its JSON schema text is {num_bytes:,} "
            f"bytes, over the limit of {max_bytes:,}", param=field_name)


def _check_depth(depth: int, field_name: str) -> None:
    if depth > MAX_SCHEMA_DEPTH:
        raise StructuredOutputError(
            f"`{field_name}` nests objects and arrays more than {MAX_SCHEMA_DEPTH} levels deep",
            param=field_name)


def nesting_depth(value: Any, limit: int) -> int:
    """Levels of dicts and lists in `value`, counted without recursion; stops once past
    `limit` (the answer is then limit + 1)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def json_text_depth(text: str) -> int:
    """Levels of objects and arrays in a JSON text, brackets inside strings ignored."""
    brackets = _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(1 if b in "[{" else -1 for b in brackets), default=0)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite strings with minLength / maxLength as an equivalent pattern.

    xgrammar 0.2.9 lets raw control characters into length-bounded strings (invalid JSON);
    the pattern it builds for `[^"\\\x00-\x1f]{m,n}` does not. Such strings then hold no
    escape sequences, which only narrows what the model may write. Recursive: callers check
    the depth first.
    """
    if isinstance(schema, list):
        return [bounded_strings_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {key: bounded_strings_as_patterns(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    if schema.get("type") == "string" and bounded and "pattern" not in schema \
            and "format" not in schema:
        low = rewritten.pop("minLength", 0)
        high = rewritten.pop("maxLength", "")
        rewritten["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{low},{high}}}$'
    return rewritten

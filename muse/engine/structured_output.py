"""Constrained decoding with xgrammar: JSON, JSON Schema, and forced tool calls.

A request's constraint is compiled once at admission (a bad schema is refused there) and each
sample gets its own matcher. Before sampling, the matcher's token bitmask removes every token
the grammar does not allow; after sampling the token is fed to the matcher. When the grammar
is complete only the model's stop tokens remain allowed, so generation ends there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from muse.engine.errors import InvalidRequestError

# With parallel tool calls a forced reply may hold this many calls.
MAX_FORCED_TOOL_CALLS = 4


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match.

    kind "json": any JSON object; "json_schema": `schema`; "tool_calls": one tool call (or up
    to MAX_FORCED_TOOL_CALLS when `parallel`) to one of `tools` (OpenAI function definitions),
    in the chat format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
    """

    kind: Literal["json", "json_schema", "tool_calls"]
    schema: str | None = None  # JSON text, so the spec stays hashable for the compile cache
    tools: tuple[str, ...] = field(default_factory=tuple)  # JSON text of each function
    parallel: bool = False

    @staticmethod
    def for_schema(schema: dict[str, Any]) -> StructuredOutput:
        return StructuredOutput("json_schema",
                                schema=json.dumps(bounded_strings_as_patterns(schema),
                                                  sort_keys=True))

    @staticmethod
    def for_tools(functions: list[dict[str, Any]], parallel: bool) -> StructuredOutput:
        return StructuredOutput("tool_calls", tools=tuple(json.dumps(f, sort_keys=True)
                                                          for f in functions),
                                parallel=parallel)


def bounded_strings_as_patterns(schema: Any) -> Any:
    """Rewrite strings with minLength / maxLength as an equivalent pattern.

    xgrammar 0.2.9 lets raw control characters into length-bounded strings (invalid JSON);
    the pattern it builds for `[^"\\\x00-\x1f]{m,n}` does not. Such strings then hold no
    escape sequences, which only narrows what the model may write.
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


def _tool_call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary (cached per constraint)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        # The model's vocabulary may be larger than the tokenizer's (padding rows).
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                      vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info)
        self.vocab_size = vocab_size
        self._cache: dict[StructuredOutput, Any] = {}

    def compile(self, spec: StructuredOutput):
        if spec not in self._cache:
            self._cache[spec] = self._compile(spec)
        return self._cache[spec]

    def _compile(self, spec: StructuredOutput):
        xgr = self.xgr
        try:
            if spec.kind == "json":
                return self.compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.schema, any_whitespace=False)
            functions = [json.loads(t) for t in spec.tools]
            call = xgr.Grammar.from_json_schema(json.dumps(_tool_call_schema(functions)),
                                                any_whitespace=False)
            tagged = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>"'), call,
                                        xgr.Grammar.from_ebnf('root ::= "</tool_call>"'))
            counts = range(1, (MAX_FORCED_TOOL_CALLS if spec.parallel else 1) + 1)
            grammar = xgr.Grammar.union(*[xgr.Grammar.concat(*[tagged] * n) for n in counts]) \
                if spec.parallel else tagged
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            field_name = "tools" if spec.kind == "tool_calls" else "response_format"
            raise InvalidRequestError(f"cannot build a grammar from `{field_name}`: {error}",
                                      param=field_name) from None

    def matcher(self, spec: StructuredOutput):
        return self.xgr.GrammarMatcher(self.compile(spec))

    def apply(self, logits: torch.Tensor, matchers: list) -> None:
        """Mask, in place, the tokens each row's matcher forbids (rows with None are free)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self.xgr.allocate_token_bitmask(len(logits), self.vocab_size)
        bitmask.fill_(-1)  # all tokens allowed on unconstrained rows
        for i in rows:
            matchers[i].fill_next_token_bitmask(bitmask, i)
        cpu_logits = logits.cpu() if logits.device.type != "cpu" else logits
        self.xgr.apply_token_bitmask_inplace(cpu_logits, bitmask, vocab_size=self.vocab_size)
        if cpu_logits is not logits:
            logits.copy_(cpu_logits)

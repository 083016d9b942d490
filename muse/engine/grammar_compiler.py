"""xgrammar against one tokenizer: constraints -> compiled grammars, and the per-step mask.

`compile` is slow for large schemas (seconds to minutes) and runs on the compile threads of
`grammar_jobs.py`; `apply` runs in the engine's step for every constrained batch.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from muse.chat_format import TOOL_CALL_END_TOKEN, TOOL_CALL_START_TOKEN
from muse.engine.grammar_matcher import RequestGrammar
from muse.engine.structured_output import (
    MAX_FORCED_TOOL_CALLS,
    StructuredOutput,
    StructuredOutputError,
    is_strict,
)

# xgrammar prefixes its messages with a time and its C++ source location, e.g.
# "[14:52:59] /project/cpp/json_schema_converter.cc:5082: Unsupported type", and sometimes
# with the failed internal check; the client gets only the human part.
_LOCATION = re.compile(r"^\s*\[[\d:.]+\]\s*\S+?:\d+:\s*")
_FAILED_CHECK = re.compile(r"^Check failed: .*? is false:\s*")
# Parse errors append the whole schema, which can be hundreds of KB.
_ECHOED_INPUT = re.compile(r"\s*The JSON string is:.*$", re.DOTALL)
MAX_ERROR_CHARS = 300


def _tool_call_schema(functions: list[dict[str, Any]]) -> dict[str, Any]:
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _triggered_tool_calls(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """xgrammar's structural tag for calls inside free text: `<tool_call>` opens a call whose
    name must be an offered function's and whose arguments must fit its schema when it is
    strict (any object otherwise); the call's end frees the text again."""
    def arguments(function: dict[str, Any]) -> dict[str, Any]:
        if is_strict(function):
            return function.get("parameters") or {"type": "object", "properties": {}}
        return {"type": "object", "additionalProperties": True}

    tags = [{"type": "tag",
             "begin": f'{TOOL_CALL_START_TOKEN}{{"name": {json.dumps(f["name"])}, "arguments": ',
             # One space at most between JSON tokens: the chat format writes ", " and ": ",
             # and unbounded whitespace would let a weak model loop on it.
             "content": {"type": "json_schema", "json_schema": arguments(f),
                         "max_whitespace_cnt": 1},
             "end": f"}}{TOOL_CALL_END_TOKEN}"} for f in functions]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [TOOL_CALL_START_TOKEN],
                       "tags": tags, "stop_after_first": not parallel}}


def clean_error_message(error: BaseException) -> str:
    """xgrammar's message without its timestamp, source path, internal check or echoed input."""
    lines = [_FAILED_CHECK.sub("", _LOCATION.sub("", line)).strip()
             for line in _ECHOED_INPUT.sub("", str(error)).splitlines()]
    message = " ".join(line for line in lines if line) or type(error).__name__
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS - 3] + "..."
    return message


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary; uncached (see GrammarCache)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int],
                 max_threads: int = 8) -> None:
        import xgrammar

        self.xgr = xgrammar
        # The model's vocabulary may be larger than the tokenizer's (padding rows).
        vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                                      vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache has no bound by default and would keep every grammar a second
        # time; the engine's byte-bounded LRU (grammar_cache.py) is the only cache.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=max_threads,
                                                 cache_enabled=False)
        self.vocab_size = vocab_size

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`; a constraint xgrammar refuses raises
        StructuredOutputError naming the request field. Thread-safe; releases the GIL."""
        xgr = self.xgr
        try:
            if spec.kind == "json":
                # The same compact layout as a schema's, rather than xgrammar's builtin JSON
                # grammar, which lets the model write whitespace anywhere.
                return self.compiler.compile_json_schema('{"type": "object"}',
                                                         any_whitespace=False,
                                                         strict_mode=False)
            if spec.kind == "json_schema":
                return self.compiler.compile_json_schema(spec.schema, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.schema)
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(spec.schema)
            if spec.kind == "choice":
                # Each choice as an EBNF string literal: JSON's escapes are the grammar's.
                return self.compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(choice, ensure_ascii=False) for choice in json.loads(spec.schema)))
            functions = [json.loads(t) for t in spec.tools]
            if not spec.forced:
                return self.compiler.compile_structural_tag(
                    json.dumps(_triggered_tool_calls(functions, spec.parallel)))
            call = xgr.Grammar.from_json_schema(json.dumps(_tool_call_schema(functions)),
                                                any_whitespace=False)
            tagged = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>"'), call,
                                        xgr.Grammar.from_ebnf('root ::= "</tool_call>"'))
            counts = range(1, (MAX_FORCED_TOOL_CALLS if spec.parallel else 1) + 1)
            grammar = xgr.Grammar.union(*[xgr.Grammar.concat(*[tagged] * n) for n in counts]) \
                if spec.parallel else tagged
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:
            raise StructuredOutputError(
                f"cannot build a grammar from `{spec.field_name}`: {clean_error_message(error)}",
                param=spec.field_name) from None

    def matcher(self, compiled, spec: StructuredOutput, prompt_token_ids: list[int]
                ) -> RequestGrammar:
        return RequestGrammar(self.xgr.GrammarMatcher(compiled), spec.reasoning_start_token_id,
                              spec.reasoning_end_token_id, prompt_token_ids)

    def apply(self, logits: torch.Tensor, grammars: list[RequestGrammar | None]) -> None:
        """Mask, in place, the tokens each row's grammar forbids (rows with None, or still
        in their reasoning block, are free)."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.active]
        if not rows:
            return
        bitmask = self.xgr.allocate_token_bitmask(len(logits), self.vocab_size)
        bitmask.fill_(-1)  # all tokens allowed on unconstrained rows
        for i in rows:
            grammars[i].fill_bitmask(bitmask, i)
        cpu_logits = logits.cpu() if logits.device.type != "cpu" else logits
        self.xgr.apply_token_bitmask_inplace(cpu_logits, bitmask, vocab_size=self.vocab_size)
        if cpu_logits is not logits:
            logits.copy_(cpu_logits)

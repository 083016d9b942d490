"""Strict functions under tool_choice "auto": free text, and every call checked as it is
written (an offered name; a strict function's schema; any object for the others)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from muse import LLM, SamplingParams
from muse.chat_format import END_OF_TURN_ID, TOOL_CALL_START_ID
from muse.engine.structured_output import strict_tool_calls, without_strict
from tests.engine.helpers import tiny_llm


def tool(name: str, parameters: dict, strict: bool = True) -> dict:
    function = {"name": name, "parameters": parameters}
    if strict:
        function["strict"] = True
    return {"type": "function", "function": function}


FORECAST = {"type": "object", "additionalProperties": False, "required": ["unit", "exact"],
            "properties": {"unit": {"enum": ["c", "f"]}, "exact": {"type": "boolean"}}}
ALARM = {"type": "object", "additionalProperties": False, "required": ["on"],
         "properties": {"on": {"type": "boolean"}}}
LOOSE = {"type": "object", "properties": {"order_id": {"type": "string"}}}
TOOLS = [tool("get_forecast", FORECAST), tool("set_alarm", ALARM), tool("cancel", LOOSE, False)]
SCHEMAS = {"get_forecast": FORECAST, "set_alarm": ALARM}
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_llm()


def accepts(llm: LLM, parallel: bool, text: str) -> bool:
    """Whether the grammar takes `text`, then the end of the turn."""
    compiler = llm.engine._grammar_jobs().compiler
    matcher = compiler.xgr.GrammarMatcher(compiler.compile(strict_tool_calls(TOOLS, parallel)))
    return all(matcher.accept_token(token) for token in llm.tokenizer.encode(text)) \
        and matcher.accept_token(END_OF_TURN_ID)


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_frees_text_and_checks_each_call(llm, parallel):
    good = call("get_forecast", '{"unit": "c", "exact": true}')
    assert accepts(llm, parallel, "Any text at all, even {braces}.")
    assert accepts(llm, parallel, "Let me look." + good)
    assert accepts(llm, parallel, call("cancel", '{"order_id": "A-1", "extra": [1, 2]}'))
    assert not accepts(llm, parallel, call("get_forcast", '{"unit": "c", "exact": true}'))
    assert not accepts(llm, parallel, call("get_forecast", '{"unit": "k", "exact": true}'))
    assert not accepts(llm, parallel, call("get_forecast", '{"unit": "c"}'))
    assert not accepts(llm, parallel, call("set_alarm", '{"on": true, "at": 7}'))
    assert not accepts(llm, parallel, call("get_forecast", '{"unit":  "c", "exact": true}'))
    # Several calls, and text after one, only with parallel calls.
    assert accepts(llm, parallel, good + " Done.") == parallel
    assert accepts(llm, parallel, good + call("set_alarm", '{"on": false}')) == parallel


def test_no_strict_function_means_no_constraint():
    assert strict_tool_calls([tool("cancel", LOOSE, False)], parallel=True) is None
    assert strict_tool_calls(None, parallel=True) is None
    assert without_strict(TOOLS)[0] == {"type": "function", "function": {
        "name": "get_forecast", "parameters": FORECAST}}


def calls_written(llm: LLM, tools: list[dict], seed: int) -> list[str]:
    """The `<tool_call>` spans of a reply pushed to open calls at every chance."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=160,
                            logit_bias={TOOL_CALL_START_ID: 40.0})
    [output] = llm.chat([{"role": "user", "content": "Will it rain?"}], params, tools=tools,
                        use_tqdm=False)
    text = llm.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=False)
    return CALL.findall(text)


@pytest.mark.parametrize("seed", [0, 1])
def test_chat_with_strict_tools_writes_only_valid_calls(llm, seed):
    strict_only = TOOLS[:2]
    calls = calls_written(llm, strict_only, seed)
    assert calls, "the bias opens a call"
    for text in calls:
        written = json.loads(text)
        assert set(written) == {"name", "arguments"}
        jsonschema.validate(written["arguments"], SCHEMAS[written["name"]])
    # Negative control: the same functions without `strict` leave the random model free,
    # and what follows its `<tool_call>` is no valid call.
    loose = calls_written(llm, without_strict(strict_only), seed)
    assert not any(_valid(text) for text in loose)


def _valid(text: str) -> bool:
    try:
        written = json.loads(text)
        jsonschema.validate(written["arguments"], SCHEMAS[written["name"]])
    except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
        return False
    return True


def test_strict_is_not_shown_to_the_model(llm):
    messages = [{"role": "user", "content": "Will it rain?"}]
    assert llm.tokenizer.apply_chat_template(messages, tools=without_strict(TOOLS),
                                             tokenize=True) \
        != llm.tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=True)
    params = SamplingParams(max_tokens=1)
    [strict], [plain] = (llm.chat(messages, params, tools=tools, use_tqdm=False)
                         for tools in (TOOLS, without_strict(TOOLS)))
    assert strict.prompt_token_ids == plain.prompt_token_ids

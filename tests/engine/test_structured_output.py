"""What constrained outputs look like: compact JSON, and a grammar that waits for the end of the
reasoning block."""

from __future__ import annotations

import dataclasses
import json

import pytest

from muse import LLM, SamplingParams
from muse.chat_format import THINK_START_ID, THINK_END_ID
from muse.engine.structured_output import StructuredOutput
from tests.engine.helpers import random_prompt, tiny_llm

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
                 "required": ["answer"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return tiny_llm()


def whitespace_outside_strings(text: str) -> list[tuple[str, str]]:
    """(character before, whitespace run) for every whitespace run outside JSON strings."""
    runs, in_string, escaped, index = [], False, False, 0
    while index < len(text):
        char = text[index]
        if in_string:
            escaped = char == "\\" and not escaped
            in_string = char != '"' or escaped
        elif char == '"':
            in_string = True
        elif char.isspace():
            end = index
            while end < len(text) and text[end].isspace():
                end += 1
            runs.append((text[index - 1] if index else "", text[index:end]))
            index = end
            continue
        index += 1
    return runs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_object_output_is_compact(llm, seed):
    """Whitespace tokens pushed up as far as they go: the json_object grammar still allows
    only the one space after each `:` and `,` (the layout of json_schema outputs)."""
    tokenizer = llm.tokenizer
    texts = {i: tokenizer.decode([i]) for i in range(32, tokenizer.vocab_size)}
    spaces = {i: 8.0 for i, text in texts.items() if text.isspace()}
    # Tokens such as `{"` would skip the place after the brace where whitespace could go.
    merged = {i: -100.0 for i, text in texts.items() if text.startswith("{") and text != "{"}
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48,
                            logit_bias={**spaces, **merged},
                            structured_output=StructuredOutput("json"))
    [output] = llm.generate([random_prompt(8, seed)], params, use_tqdm=False)
    text = output.outputs[0].text
    assert text.startswith("{"), text
    assert all(before in ":," and run == " " for before, run in whitespace_outside_strings(text)), \
        text


# ---- reasoning, then the grammar ------------------------------------------------------
def reasoning_params(llm: LLM, reasoning: bool, open_block: bool = True) -> SamplingParams:
    """Greedy decoding pushed to open a reasoning block (when `open_block`), write "Z" (not
    JSON) and, once a few Z's have worn their bias down (frequency penalty), end the block."""
    z = llm.tokenizer.token_to_id("Z")
    spec = StructuredOutput.for_schema(ANSWER_SCHEMA)
    if reasoning:
        spec = dataclasses.replace(spec, reasoning_start_token_id=THINK_START_ID,
                                   reasoning_end_token_id=THINK_END_ID)
    # Enough to open the block over any JSON start, not enough to reopen it inside.
    bias = {z: 30.0, THINK_END_ID: 20.0, THINK_START_ID: 15.0 if open_block else -20.0}
    return SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=2.0,
                          logit_bias=bias, structured_output=spec)


def accepted_by_grammar(llm: LLM, token_ids: list[int]) -> bool:
    compiler = llm.engine.runner.grammar_compiler
    matcher = compiler.xgr.GrammarMatcher(
        compiler.compile(StructuredOutput.for_schema(ANSWER_SCHEMA)))
    return all(matcher.accept_token(token) for token in token_ids)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_grammar_applies_after_the_reasoning_block(llm, seed):
    z = llm.tokenizer.token_to_id("Z")
    [output] = llm.generate([random_prompt(8, seed)], reasoning_params(llm, True),
                            use_tqdm=False)
    tokens = output.outputs[0].token_ids
    end = tokens.index(THINK_END_ID)
    # The first token may open the block; inside it, free: Z is no way to start JSON.
    assert tokens[0] == THINK_START_ID and end > 1 and tokens[1:end] == [z] * (end - 1)
    assert not accepted_by_grammar(llm, [z])
    # Constrained after it: the answer is the schema's, whole.
    answer = tokens[end + 1:]
    assert accepted_by_grammar(llm, answer)
    assert output.outputs[0].finish_reason == "stop"
    assert set(json.loads(llm.tokenizer.decode(answer[:-1]))) == {"answer"}


@pytest.mark.parametrize("prompt_end, reasoning, open_block", [
    ([THINK_END_ID], True, True),  # thinking disabled: the prompt closed the block
    ([], True, False),  # the reply does not open a block: constrained from its first token
    ([], False, True),  # no reasoning block expected: <think> is no JSON
], ids=["prompt-closes-the-block", "reply-opens-no-block", "no-reasoning"])
def test_the_grammar_applies_from_the_start_without_a_block_to_wait_for(
        llm, prompt_end, reasoning, open_block):
    [output] = llm.generate([random_prompt(8, 0) + prompt_end],
                            reasoning_params(llm, reasoning, open_block), use_tqdm=False)
    tokens = output.outputs[0].token_ids
    assert THINK_START_ID not in tokens and THINK_END_ID not in tokens
    assert accepted_by_grammar(llm, tokens)
    assert set(json.loads(llm.tokenizer.decode(tokens[:-1]))) == {"answer"}


def test_reasoning_then_grammar_gives_the_same_tokens_with_and_without_overlap():
    """The overlapped schedule reads constrained steps back at once: the grammar sees each
    token (the end tag included) before the next step's mask is made."""
    prompts = [random_prompt(8, seed) for seed in range(3)]
    outputs = []
    for overlap in (True, False):
        llm = tiny_llm(overlap_schedule=overlap)
        params = [reasoning_params(llm, True), SamplingParams(max_tokens=12, seed=4),
                  reasoning_params(llm, False)]
        outputs.append([o.outputs[0].token_ids
                        for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outputs[0] == outputs[1]
    assert THINK_END_ID in outputs[0][0]


def test_properties_are_written_in_the_schema_order(llm):
    """xgrammar writes an object's properties in their declared order, so the schema text
    must keep the request's order (not sort it): OpenAI's structured outputs do the same."""
    schema = {"type": "object", "additionalProperties": False, "required": ["zeta", "alpha"],
              "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}}}
    params = SamplingParams(temperature=0.0, max_tokens=32,
                            structured_output=StructuredOutput.for_schema(schema))
    [output] = llm.generate([random_prompt(8, 0)], params, use_tqdm=False)
    assert list(json.loads(llm.tokenizer.decode(output.outputs[0].token_ids[:-1]))) == \
        ["zeta", "alpha"]

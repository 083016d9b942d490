import json
import random
import re

import pytest

from muse.server.parsers import (
    ChatOutputParser,
    ContentDelta,
    MuseReasoningParser,
    MuseToolCallParser,
    ToolCallArgumentsDelta,
    ToolCallStart,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]
CALL_ID = re.compile(r"call_[0-9a-zA-Z]{24}")


def call(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return "<tool_call>" + body + "</tool_call>"


def parse(text: str, reasoning: bool = True, tools: bool = True, offered_tools: list | None = None):
    """(reasoning, content, [(name, arguments object)]) of the non-streaming parse."""
    message = ChatOutputParser(reasoning, tools, offered_tools).parse(text)
    for tool_call in message.tool_calls:
        assert CALL_ID.fullmatch(tool_call.id)
        assert tool_call.arguments == json.dumps(json.loads(tool_call.arguments), ensure_ascii=False)
    calls = [(c.name, json.loads(c.arguments)) for c in message.tool_calls]
    return message.reasoning_content, message.content, calls


# ---- non-streaming ---------------------------------------------------------------------


def test_reply_without_think_block_is_all_content():
    assert parse("Hello there.") == (None, "Hello there.", [])


def test_think_only():
    assert parse("<think>just thinking</think>") == ("just thinking", None, [])


def test_think_and_content():
    assert parse("<think>2 + 2 = 4</think>The answer is 4.") == ("2 + 2 = 4", "The answer is 4.", [])


def test_empty_think_block_from_disabled_thinking():
    assert parse("<think></think>Hi") == ("", "Hi", [])


def test_leading_whitespace_before_think():
    assert parse(" \n<think>r</think>c") == ("r", "c", [])


def test_think_tag_after_text_is_content():
    text = "Use <think>tags</think> like this."
    assert parse(text) == (None, text, [])


def test_unterminated_think_is_all_reasoning():
    text = '<think>step one, maybe <tool_call>{"name": "search", "arguments": {}}</tool_call>'
    assert parse(text) == (text[len("<think>") :], None, [])


def test_think_and_tool_call():
    text = "<think>need weather</think>" + call("get_weather", {"city": "Paris"})
    assert parse(text) == ("need weather", None, [("get_weather", {"city": "Paris"})])


def test_several_tool_calls_keep_order_and_get_distinct_ids():
    text = call("get_weather", {"city": "Paris"}) + call("search", {"q": "x"}) + call("search", {"q": "y"})
    message = ChatOutputParser(reasoning=True, tools=True, offered_tools=None).parse(text)
    assert [(c.name, c.arguments) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("search", '{"q": "x"}'),
        ("search", '{"q": "y"}'),
    ]
    assert len({c.id for c in message.tool_calls}) == 3
    assert message.content is None


def test_content_around_and_between_tool_calls_is_kept():
    text = "Checking." + call("search", {"q": "a"}) + " and " + call("search", {"q": "b"}) + " done"
    assert parse(text) == (None, "Checking. and  done", [("search", {"q": "a"}), ("search", {"q": "b"})])


@pytest.mark.parametrize(
    "block",
    [
        '<tool_call>{"name": "search", "arguments": {"q": "x"}</tool_call>',  # missing brace
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>',  # string arguments
        '<tool_call>{"arguments": {"q": "x"}}</tool_call>',  # no name
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',  # name not a string
        '<tool_call>["search", {}]</tool_call>',  # not an object
        '<tool_call>{"name": "search", "arguments": {"x": NaN}}</tool_call>',  # not JSON
        "<tool_call></tool_call>",
    ],
)
def test_invalid_block_stays_in_content_verbatim(block):
    text = "before " + block + call("search", {"q": "ok"}) + " after"
    assert parse(text) == (None, "before " + block + " after", [("search", {"q": "ok"})])


def test_unknown_tool_stays_content_when_tools_are_offered():
    unknown = call("delete_everything", {})
    text = unknown + call("search", {"q": "x"})
    assert parse(text, offered_tools=TOOLS) == (None, unknown, [("search", {"q": "x"})])
    assert parse(text)[2] == [("delete_everything", {}), ("search", {"q": "x"})]


def test_bare_function_tool_dicts_are_accepted_as_offered_tools():
    assert parse(call("search", {}), offered_tools=[{"name": "search"}])[2] == [("search", {})]


def test_unicode_arguments_are_kept_unescaped():
    arguments = '{"city": "S\\u00e3o Paulo", "emoji": "🎉"}'
    text = '<tool_call>{"name": "get_weather", "arguments": ' + arguments + "}</tool_call>"
    message = ChatOutputParser(reasoning=True, tools=True).parse(text)
    assert message.tool_calls[0].arguments == '{"city": "São Paulo", "emoji": "🎉"}'


def test_arguments_are_reserialised_compactly():
    text = '<tool_call>\n{"name":"search",\n "arguments":{"q":"x","n":[1,2]}}\n</tool_call>'
    assert ChatOutputParser(True, True).parse(text).tool_calls[0].arguments == '{"q": "x", "n": [1, 2]}'


def test_unterminated_tool_call_is_a_call_only_when_complete():
    complete = '<tool_call>{"name": "search", "arguments": {"q": "x"}}'
    assert parse("Hi" + complete) == (None, "Hi", [("search", {"q": "x"})])
    truncated = '<tool_call>{"name": "search", "arguments": {"q": "x'
    assert parse("Hi" + truncated) == (None, "Hi" + truncated, [])


def test_tool_calls_inside_reasoning_are_not_parsed():
    text = "<think>" + call("search", {"q": "x"}) + "</think>no call"
    assert parse(text) == (call("search", {"q": "x"}), "no call", [])


def test_reasoning_disabled_keeps_think_tags_in_content():
    text = "<think>r</think>c" + call("search", {"q": "x"})
    assert parse(text, reasoning=False) == (None, "<think>r</think>c", [("search", {"q": "x"})])


def test_tools_disabled_keeps_blocks_in_content():
    text = "<think>r</think>c" + call("search", {"q": "x"})
    assert parse(text, tools=False) == ("r", "c" + call("search", {"q": "x"}), [])


# ---- streaming -------------------------------------------------------------------------


def stream(chunks: list[str], reasoning: bool = True, tools: bool = True, offered_tools: list | None = None):
    """Feeds `chunks` and joins the deltas into (reasoning, content, [(name, arguments)]),
    checking the OpenAI delta rules on the way: a call's first delta carries its id and
    name, later ones neither, and calls are numbered 0, 1, ... in order."""
    parser = ChatOutputParser(reasoning, tools, offered_tools)
    reasoning_text, content, calls = "", "", []
    for message in [parser.feed(chunk) for chunk in chunks] + [parser.finish()]:
        reasoning_text += message.reasoning_content or ""
        content += message.content or ""
        assert message.reasoning_content != "" and message.content != ""
        for delta in message.tool_calls:
            if delta.index == len(calls):
                assert CALL_ID.fullmatch(delta.id) and delta.name
                assert delta.id not in {c[0] for c in calls}
                calls.append([delta.id, delta.name, delta.arguments])
            else:
                assert delta.index == len(calls) - 1 and delta.id is None and delta.name is None
                calls[-1][2] += delta.arguments
    return reasoning_text, content, [(name, json.loads(arguments)) for _, name, arguments in calls]


def normalised(parsed):
    reasoning, content, calls = parsed
    return reasoning or "", content or "", calls


REPLIES = [
    # reasoning that looks like tags, content, two calls with braces, quotes and unicode
    # inside strings, text between and after the calls, and a trailing partial tag.
    (
        '<think>Maybe {"x": 1} </th or <tool_call> São 天气…</think>Sure — checking.'
        + call("get_weather", {"city": "São Paulo", "note": 'say "hi" {not a brace} </tool <think>'})
        + " then "
        + call("search", {"q": "a}b{c\\", "nested": {"list": [1, {"k": "日本 🎉"}]}})
        + " after <tool",
        TOOLS,
        (
            'Maybe {"x": 1} </th or <tool_call> São 天气…',
            "Sure — checking. then  after <tool",
            [
                ("get_weather", {"city": "São Paulo", "note": 'say "hi" {not a brace} </tool <think>'}),
                ("search", {"q": "a}b{c\\", "nested": {"list": [1, {"k": "日本 🎉"}]}}),
            ],
        ),
    ),
    # an invalid block, an unknown tool and an unterminated but complete last call.
    (
        '  <think></think>Hi<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"</tool_call>ok'
        + call("unknown_tool", {"a": "ü"})
        + '<tool_call>{"name": "search", "arguments": {"q": "emoji 🎉 \\"quoted\\""}}',
        TOOLS,
        (
            "",
            'Hi<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"</tool_call>ok'
            + call("unknown_tool", {"a": "ü"}),
            [("search", {"q": 'emoji 🎉 "quoted"'})],
        ),
    ),
    # no think block: a late think tag and a lone "<" are content.
    (
        "a < b <thinking></think> <" + call("search", {"q": "<tool_call"}) + "<tool_call>{",
        None,
        (
            "",
            "a < b <thinking></think> <<tool_call>{",
            [("search", {"q": "<tool_call"})],
        ),
    ),
    # ran out of tokens while thinking.
    (
        "<think>plan: " + call("search", {"q": "x"}) + " </thi",
        TOOLS,
        ("plan: " + call("search", {"q": "x"}) + " </thi", "", []),
    ),
]
REPLY_NAMES = [
    "reasoning-content-two-calls",
    "invalid-unknown-unterminated",
    "no-think",
    "unterminated-think",
]


@pytest.mark.parametrize("reply, offered_tools, expected", REPLIES, ids=REPLY_NAMES)
def test_non_streaming_parse_of_streaming_replies(reply, offered_tools, expected):
    assert normalised(parse(reply, offered_tools=offered_tools)) == expected


@pytest.mark.parametrize("reply, offered_tools, expected", REPLIES, ids=REPLY_NAMES)
def test_streaming_two_chunks_split_anywhere(reply, offered_tools, expected):
    for split in range(len(reply) + 1):
        assert stream([reply[:split], reply[split:]], offered_tools=offered_tools) == expected, split


@pytest.mark.parametrize("reply, offered_tools, expected", REPLIES, ids=REPLY_NAMES)
def test_streaming_three_chunks(reply, offered_tools, expected):
    for first in range(len(reply) + 1):
        for second in range(first, len(reply) + 1, 3):
            chunks = [reply[:first], reply[first:second], reply[second:]]
            assert stream(chunks, offered_tools=offered_tools) == expected, (first, second)


@pytest.mark.parametrize("reply, offered_tools, expected", REPLIES, ids=REPLY_NAMES)
def test_streaming_character_by_character_and_random_chunks(reply, offered_tools, expected):
    assert stream(list(reply), offered_tools=offered_tools) == expected
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(reply) + 1), rng.randint(1, 12)))
        chunks = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
        assert stream(chunks, offered_tools=offered_tools) == expected, cuts


@pytest.mark.parametrize("reasoning, tools", [(False, True), (True, False), (False, False)])
@pytest.mark.parametrize("reply, offered_tools, expected", REPLIES, ids=REPLY_NAMES)
def test_streaming_matches_parse_with_parsers_disabled(reply, offered_tools, expected, reasoning, tools):
    whole = normalised(parse(reply, reasoning, tools, offered_tools))
    assert stream(list(reply), reasoning, tools, offered_tools) == whole
    for split in range(len(reply) + 1):
        assert stream([reply[:split], reply[split:]], reasoning, tools, offered_tools) == whole, split
    if not reasoning and not tools:
        assert whole == ("", reply, [])


# ---- latency: text is held back only while it can still be a tag -----------------------


def test_reasoning_parser_releases_text_that_cannot_be_a_tag():
    parser = MuseReasoningParser()
    assert parser.feed("  <thi") == []
    assert parser.feed("nk>ab</th") == [("reasoning", "ab")]
    assert parser.feed("ey") == [("reasoning", "</they")]
    assert parser.feed(" x</think>y") == [("reasoning", " x"), ("content", "y")]
    assert parser.finish() == []

    parser = MuseReasoningParser()
    assert parser.feed("<tx") == [("content", "<tx")]


def test_delta_message_is_empty_while_text_is_held():
    parser = ChatOutputParser(reasoning=True, tools=True)
    assert parser.feed("<thi").is_empty()
    assert parser.feed("nk>").is_empty()
    assert not parser.feed("a").is_empty()


def test_reasoning_parser_finish_flushes_held_partial_tag():
    parser = MuseReasoningParser()
    assert parser.feed("<think>abc</thin") == [("reasoning", "abc")]
    assert parser.finish() == [("reasoning", "</thin")]


def test_tool_call_parser_holds_back_at_most_a_tag_prefix():
    parser = MuseToolCallParser()
    assert parser.feed("x" * 50 + "<tool_cal") == [ContentDelta("x" * 50)]
    assert parser.feed("m") == [ContentDelta("<tool_calm")]
    assert parser.feed("Hi <tool") == [ContentDelta("Hi ")]
    assert parser.feed("box>") == [ContentDelta("<toolbox>")]


def test_tool_call_is_emitted_when_its_block_closes():
    parser = MuseToolCallParser(TOOLS)
    assert parser.feed('<tool_call>{"name": "search", "arguments": {"q": "x"}}') == []
    events = parser.feed("</tool_call>")
    assert len(events) == 2
    start, arguments = events
    assert isinstance(start, ToolCallStart) and (start.index, start.name) == (0, "search")
    assert isinstance(arguments, ToolCallArgumentsDelta)
    assert (arguments.index, arguments.text) == (0, '{"q": "x"}')
    assert parser.finish() == []


def test_invalid_streamed_block_comes_back_as_content():
    parser = MuseToolCallParser()
    assert parser.feed('<tool_call>{"name": "search"}</tool_call>') == [
        ContentDelta('<tool_call>{"name": "search"}</tool_call>')
    ]

"""The chat template renders the documented format (docs/formats.md, "Chat format")."""

from __future__ import annotations

import jinja2
import pytest

from muse.chat_format import (
    CHAT_TEMPLATE,
    END_OF_TURN_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    STOP_TOKEN_IDS,
    THINK_START_ID,
    TOOLS_INSTRUCTION,
    is_special_token_id,
    special_token_id,
)
from muse.tokenizer import compile_chat_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER_TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}'
)


def render(messages: list[dict], **variables: object) -> str:
    variables.setdefault("tools", None)
    variables.setdefault("add_generation_prompt", False)
    return compile_chat_template(CHAT_TEMPLATE).render(messages=messages, **variables)


def test_special_token_ids_are_fixed() -> None:
    assert len(SPECIAL_TOKENS) == 32
    assert SPECIAL_TOKENS[:12] == [
        "<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>",
        "<|tool|>", "<|end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
    ]
    assert SPECIAL_TOKENS[12:21] == [
        "<|image_start|>", "<|image|>", "<|image_end|>", "<|video_start|>", "<|video|>",
        "<|video_end|>", "<|audio_start|>", "<|audio|>", "<|audio_end|>",
    ]
    assert SPECIAL_TOKENS[21] == "<|reserved_21|>"
    assert SPECIAL_TOKENS[31] == "<|reserved_31|>"
    assert len(set(SPECIAL_TOKENS)) == 32
    assert special_token_id("<think>") == THINK_START_ID == 8
    assert STOP_TOKEN_IDS == (END_OF_TURN_ID, EOS_ID) == (7, 2)
    with pytest.raises(ValueError, match="unknown special token"):
        special_token_id("<|nope|>")
    assert is_special_token_id(0) and is_special_token_id(31)
    assert not is_special_token_id(32) and not is_special_token_id(-1)


def test_basic_conversation() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(messages) == (
        "<|bos|><|system|>Be brief.<|end|>\n<|user|>Hi<|end|>\n<|assistant|>Hello!<|end|>\n<|user|>Bye<|end|>\n"
    )


def test_generation_prompt_with_and_without_thinking() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert render(messages, add_generation_prompt=True) == "<|bos|><|user|>Hi<|end|>\n<|assistant|>"
    assert render(messages, add_generation_prompt=True, enable_thinking=True).endswith("<|end|>\n<|assistant|>")
    assert render(messages, add_generation_prompt=True, enable_thinking=False) == (
        "<|bos|><|user|>Hi<|end|>\n<|assistant|><think></think>"
    )
    # enable_thinking only changes the generation prompt.
    assert render(messages, enable_thinking=False) == "<|bos|><|user|>Hi<|end|>\n"


def test_tools_block_is_appended_to_system_turn() -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    assert render(messages, tools=[WEATHER_TOOL]) == (
        "<|bos|><|system|>Be brief.\n\n" + TOOLS_INSTRUCTION + "\n" + WEATHER_TOOL_JSON + "<|end|>\n"
        "<|user|>Weather?<|end|>\n"
    )


def test_tools_without_system_message_create_a_system_turn() -> None:
    second_tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    rendered = render([{"role": "user", "content": "Weather?"}], tools=[WEATHER_TOOL, second_tool])
    assert rendered == (
        "<|bos|><|system|>" + TOOLS_INSTRUCTION + "\n" + WEATHER_TOOL_JSON + "\n"
        '{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}<|end|>\n'
        "<|user|>Weather?<|end|>\n"
    )


def test_empty_tools_list_adds_no_block() -> None:
    assert render([{"role": "user", "content": "x"}], tools=[]) == "<|bos|><|user|>x<|end|>\n"


def test_assistant_reasoning_tool_calls_and_tool_results() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {
            "role": "assistant",
            "reasoning_content": "Two cities, two calls.",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Tōkyō"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "a", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "b", "content": '{"temp": 25}'},
        {"role": "assistant", "content": "21 and 25 degrees."},
    ]
    assert render(messages) == (
        "<|bos|><|user|>Weather in Paris and Tokyo?<|end|>\n"
        "<|assistant|><think>Two cities, two calls.</think>"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Tōkyō"}}</tool_call><|end|>\n'
        '<|tool|>{"temp": 21}<|end|>\n'
        '<|tool|>{"temp": 25}<|end|>\n'
        "<|assistant|>21 and 25 degrees.<|end|>\n"
    )


def test_assistant_content_before_tool_call_and_missing_content() -> None:
    messages = [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {}}}
        ]},
        {"role": "assistant", "tool_calls": [{"name": "g", "arguments": {"x": [1, 2]}}]},
        {"role": "assistant", "reasoning_content": "", "content": "Done."},
    ]
    assert render(messages) == (
        '<|bos|><|assistant|>Let me check.<tool_call>{"name": "f", "arguments": {}}</tool_call><|end|>\n'
        '<|assistant|><tool_call>{"name": "g", "arguments": {"x": [1, 2]}}</tool_call><|end|>\n'
        "<|assistant|><think></think>Done.<|end|>\n"
    )


def test_multimodal_content_parts() -> None:
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
            {"type": "text", "text": " with "},
            {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}},
            {"type": "text", "text": " and "},
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
            {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "They "}, {"type": "text", "text": "differ."}]},
    ]
    image = "<|image_start|><|image|><|image_end|>"
    video = "<|video_start|><|video|><|video_end|>"
    audio = "<|audio_start|><|audio|><|audio_end|>"
    assert render(messages) == (
        f"<|bos|><|user|>Compare {image}{image} with {video} and {audio}{audio}<|end|>\n"
        "<|assistant|>They differ.<|end|>\n"
    )


def test_unknown_role_raises() -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown message role: narrator"):
        render([{"role": "narrator", "content": "Once upon a time"}])


def test_unknown_content_part_raises() -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported content part type: file"):
        render([{"role": "user", "content": [{"type": "file", "file": {}}]}])


def test_tojson_keeps_unicode_and_does_not_escape_html() -> None:
    messages = [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "say", "arguments": {"text": "<b>héllo</b> & 日本"}}}
    ]}]
    assert '{"text": "<b>héllo</b> & 日本"}' in render(messages)

"""Special tokens and the chat template shared by every Muse tokenizer.

The ids 0..31 are fixed across all tokenizers muse builds, so model configs, the
sampler and the server parsers can refer to them without loading a tokenizer.
"""

from __future__ import annotations

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
TOOL_TOKEN = "<|tool|>"
END_OF_TURN_TOKEN = "<|end|>"
THINK_START_TOKEN = "<think>"
THINK_END_TOKEN = "</think>"
TOOL_CALL_START_TOKEN = "<tool_call>"
TOOL_CALL_END_TOKEN = "</tool_call>"
IMAGE_START_TOKEN = "<|image_start|>"
IMAGE_TOKEN = "<|image|>"
IMAGE_END_TOKEN = "<|image_end|>"
VIDEO_START_TOKEN = "<|video_start|>"
VIDEO_TOKEN = "<|video|>"
VIDEO_END_TOKEN = "<|video_end|>"
AUDIO_START_TOKEN = "<|audio_start|>"
AUDIO_TOKEN = "<|audio|>"
AUDIO_END_TOKEN = "<|audio_end|>"

NUM_SPECIAL_TOKENS = 32
FIRST_RESERVED_ID = 21

# The list position is the token id.
SPECIAL_TOKENS: list[str] = [
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    SYSTEM_TOKEN,
    USER_TOKEN,
    ASSISTANT_TOKEN,
    TOOL_TOKEN,
    END_OF_TURN_TOKEN,
    THINK_START_TOKEN,
    THINK_END_TOKEN,
    TOOL_CALL_START_TOKEN,
    TOOL_CALL_END_TOKEN,
    IMAGE_START_TOKEN,
    IMAGE_TOKEN,
    IMAGE_END_TOKEN,
    VIDEO_START_TOKEN,
    VIDEO_TOKEN,
    VIDEO_END_TOKEN,
    AUDIO_START_TOKEN,
    AUDIO_TOKEN,
    AUDIO_END_TOKEN,
] + [f"<|reserved_{i}|>" for i in range(FIRST_RESERVED_ID, NUM_SPECIAL_TOKENS)]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SYSTEM_ID = 3
USER_ID = 4
ASSISTANT_ID = 5
TOOL_ID = 6
END_OF_TURN_ID = 7
THINK_START_ID = 8
THINK_END_ID = 9
TOOL_CALL_START_ID = 10
TOOL_CALL_END_ID = 11
IMAGE_START_ID = 12
IMAGE_ID = 13
IMAGE_END_ID = 14
VIDEO_START_ID = 15
VIDEO_ID = 16
VIDEO_END_ID = 17
AUDIO_START_ID = 18
AUDIO_ID = 19
AUDIO_END_ID = 20

SPECIAL_TOKEN_IDS: dict[str, int] = {token: index for index, token in enumerate(SPECIAL_TOKENS)}

# Generation stops at the end of a turn; end of text also stops it for raw completions.
STOP_TOKEN_IDS: tuple[int, ...] = (END_OF_TURN_ID, EOS_ID)

TOOLS_INSTRUCTION = (
    "You can call the tools below, one JSON schema per line. To call one, write "
    '<tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>.'
)

# Whitespace is emitted only through explicit string literals and every tag strips
# its surroundings, so the output does not depend on the template's own layout.
# Rendered by jinja2 exactly as transformers renders chat templates (see
# muse.tokenizer.compile_chat_template).
CHAT_TEMPLATE = (
    """{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type in ('text', 'input_text') -%}
                {{- part.text -}}
            {%- elif part.type in ('image_url', 'input_image', 'image') -%}
                {{- '<|image_start|><|image|><|image_end|>' -}}
            {%- elif part.type in ('video_url', 'video') -%}
                {{- '<|video_start|><|video|><|video_end|>' -}}
            {%- elif part.type in ('audio_url', 'input_audio', 'audio') -%}
                {{- '<|audio_start|><|audio|><|audio_end|>' -}}
            {%- else -%}
                {{- raise_exception('Unsupported content part type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- macro render_tools() -%}
    {{- '"""
    + TOOLS_INSTRUCTION.replace("'", "\\'")
    + """' -}}
    {%- for tool in tools -%}
        {{- '\\n' + tool | tojson -}}
    {%- endfor -%}
{%- endmacro -%}
{{- '<|bos|>' -}}
{%- set system_first = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools and not system_first -%}
    {{- '<|system|>' + render_tools() + '<|end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'system' -%}
        {%- set text = render_content(message.content) -%}
        {%- if loop.first and tools -%}
            {%- if text -%}
                {%- set text = text + '\\n\\n' -%}
            {%- endif -%}
            {%- set text = text + render_tools() -%}
        {%- endif -%}
        {{- '<|system|>' + text + '<|end|>\\n' -}}
    {%- elif message.role == 'user' -%}
        {{- '<|user|>' + render_content(message.content) + '<|end|>\\n' -}}
    {%- elif message.role == 'assistant' -%}
        {{- '<|assistant|>' -}}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none -%}
            {{- '<think>' + message.reasoning_content + '</think>' -}}
        {%- endif -%}
        {{- render_content(message.content) -}}
        {%- if message.tool_calls is defined and message.tool_calls is not none -%}
            {%- for tool_call in message.tool_calls -%}
                {%- if tool_call.function is defined -%}
                    {%- set tool_call = tool_call.function -%}
                {%- endif -%}
                {{- '<tool_call>{"name": ' + tool_call.name | tojson + ', "arguments": ' -}}
                {%- if tool_call.arguments is string -%}
                    {{- tool_call.arguments -}}
                {%- else -%}
                    {{- tool_call.arguments | tojson -}}
                {%- endif -%}
                {{- '}</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|end|>\\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|tool|>' + render_content(message.content) + '<|end|>\\n' -}}
    {%- else -%}
        {{- raise_exception('Unknown message role: ' ~ message.role
            ~ " (allowed: 'system', 'user', 'assistant', 'tool')") -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant|>' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think></think>' -}}
    {%- endif -%}
{%- endif -%}
"""
)


def special_token_id(token: str) -> int:
    """Id of a special token string, with an error naming the valid tokens."""
    if token not in SPECIAL_TOKEN_IDS:
        raise ValueError(f"unknown special token {token!r}; expected one of {SPECIAL_TOKENS}")
    return SPECIAL_TOKEN_IDS[token]


def is_special_token_id(token_id: int) -> bool:
    """True for ids in the fixed special range 0..31."""
    return 0 <= token_id < NUM_SPECIAL_TOKENS

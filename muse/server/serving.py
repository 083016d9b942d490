"""Request -> engine input: prompt tokens, sampling parameters and output constraints.

Everything here runs before the engine sees the request, so each problem is a 400 naming the
field, and nothing is queued.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from urllib.parse import urlparse

from muse.chat_format import ASSISTANT_ID, SPECIAL_TOKENS, THINK_END_ID, THINK_START_ID, \
    TOOL_CALL_END_ID, TOOL_CALL_START_ID
from muse.engine.errors import InvalidRequestError
from muse.engine.sampling_params import SamplingParams, validate_prompt
from muse.engine.structured_output import StructuredOutput, strict_tool_calls, without_strict
from muse.multimodal.media import DEFAULT_LIMIT_MM_PER_PROMPT, DEFAULT_VIDEO_FPS, MediaError, \
    MediaLimits, load_part
from muse.server.errors import APIError
from muse.server.json_body import json_strings
from muse.server.messages import EngineReady, MediaArray
from muse.server.output_constraints import invalid_request_as_400, structured_output_for
from muse.server.protocol import ChatCompletionRequest, CompletionRequest, MMProcessorKwargs

# A chat reply keeps the tags its parsers read and drops the other special tokens.
CHAT_HIDDEN_TOKEN_IDS = frozenset(range(len(SPECIAL_TOKENS))) - {
    THINK_START_ID, THINK_END_ID, TOOL_CALL_START_ID, TOOL_CALL_END_ID}
MEDIA_PARTS = {"image_url": "image", "input_image": "image", "video_url": "video",
               "audio_url": "audio", "input_audio": "audio"}


@dataclass
class ServerOptions:
    served_model_name: str
    # Other names a request's `model` may give (the model argument as typed, more
    # --served-model-name values).
    model_aliases: frozenset[str] = frozenset()
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None
    max_queued_requests: int = 1024
    max_response_logprobs: int = 100_000
    max_request_body_bytes: int | None = None  # None: default_body_limit once ready
    request_body_timeout_s: float = 30.0
    allowed_origins: list[str] | None = None  # CORS; off unless given
    log_stats_interval_s: float | None = 5.0  # None: no periodic stats lines
    # Bytes of the tokenizer's longest token: a text longer than max_model_len times this
    # cannot fit, so it is refused without tokenizing it.
    max_token_bytes: int = 1
    # How media parts are fetched and decoded (the --allowed-media-* and --max-* flags).
    media_limits: MediaLimits = dataclasses.field(default_factory=MediaLimits)
    # The frames a second videos are sampled at (--mm-processor-kwargs '{"fps": ...}');
    # None: the model's setting.
    video_fps: float | None = None
    # Most media parts of each kind in one request (--limit-mm-per-prompt).
    limit_mm_per_prompt: dict[str, int] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_LIMIT_MM_PER_PROMPT))
    # The LoRA adapters the engine serves, name -> path: a request's `model` may name one
    # (kept current by the load / unload routes).
    lora_adapters: dict[str, str] = dataclasses.field(default_factory=dict)


def default_body_limit(max_model_len: int, max_token_bytes: int) -> int:
    """A few MB above the longest prompt the model accepts, as text or as token ids."""
    return 4 * 2**20 + max_model_len * max(8, max_token_bytes)


def check_model(requested: str | None, options: ServerOptions) -> None:
    if requested is not None and requested != options.served_model_name \
            and requested not in options.model_aliases \
            and requested not in options.lora_adapters:
        raise APIError(404, f"The model `{requested}` does not exist.", param="model",
                       code="model_not_found")


def lora_name_for(requested: str | None, options: ServerOptions) -> str | None:
    """The adapter a request's `model` selects (vLLM's rule); None for the base model."""
    return requested if requested in options.lora_adapters else None


def response_model(requested: str | None, options: ServerOptions) -> str:
    """The `model` of a response: the adapter's name when one ran, else the served name."""
    return lora_name_for(requested, options) or options.served_model_name


@dataclass(frozen=True)
class MediaPart:
    """A media content part to decode: `where` names it (`messages[0].content[1]`)."""

    where: str
    kind: str  # "image", "video" or "audio"
    part: dict
    video_fps: float = DEFAULT_VIDEO_FPS  # a video's sampling rate (`video_fps_for`)


def video_fps_for(kwargs: MMProcessorKwargs | None, ready: EngineReady,
                  options: ServerOptions) -> float:
    """The rate a request's videos are sampled at: the request's `mm_processor_kwargs.fps`,
    else the server's (`--mm-processor-kwargs`), else the model's."""
    if kwargs is not None and kwargs.fps is not None:
        return kwargs.fps
    return options.video_fps if options.video_fps is not None else ready.video_fps


def check_media(messages: list, ready: EngineReady,
                limits: dict[str, int] | None = None,
                video_fps: float = DEFAULT_VIDEO_FPS) -> list[MediaPart]:
    """Check every content part's fields and return the media parts in prompt order, videos
    to be sampled at `video_fps`.

    Only the fields are checked here (cheap, before anything is fetched); a part of a kind
    the model has no encoder for is refused too, and so is a part past `limits` (the most
    parts of a kind in one request).
    """
    limits = DEFAULT_LIMIT_MM_PER_PROMPT if limits is None else limits
    parts: list[MediaPart] = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            kind = part.get("type") if isinstance(part, dict) else None
            where = f"messages[{i}].content[{j}]"
            if kind in ("text", "input_text"):
                if not isinstance(part.get("text"), str):
                    raise APIError(400, f"{where}.text must be a string", param=where)
                continue
            if kind not in MEDIA_PARTS:
                raise APIError(400, f"{where}.type {kind!r} is not a known content part type",
                               param=f"{where}.type")
            _check_media_fields(part, kind, where)
            if MEDIA_PARTS[kind] not in ready.media_kinds:
                raise APIError(400, f"{where}: this model takes no {MEDIA_PARTS[kind]} input "
                                    "(it has no encoder for it)", param=where,
                               code="invalid_value")
            media_kind = MEDIA_PARTS[kind]
            if sum(p.kind == media_kind for p in parts) >= limits.get(media_kind, 0):
                raise APIError(400, f"{where}: more than {limits.get(media_kind, 0)} "
                                    f"{media_kind} part(s) in one request "
                                    "(--limit-mm-per-prompt)", param=where,
                               code="invalid_value")
            parts.append(MediaPart(where, media_kind, part, video_fps))
    return parts


def _check_media_fields(part: dict, kind: str, where: str) -> None:
    if kind == "input_audio":
        payload = part.get("input_audio")
        if not isinstance(payload, dict) or not isinstance(payload.get("data"), str):
            raise APIError(400, f"{where}.input_audio.data must be a base64 string",
                           param=f"{where}.input_audio.data")
        return
    # Chat Completions nests the URL ({"image_url": {"url": ...}}); the Responses API's
    # input_image gives it directly ({"image_url": "..."}).
    field = "image_url" if kind == "input_image" else kind
    payload = part.get(field)
    url = payload.get("url") if isinstance(payload, dict) else payload
    parsed = urlparse(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https", "data") or \
            (parsed.scheme != "data" and not parsed.netloc):
        raise APIError(400, f"{where}.{field}.url must be an http(s) or data URL",
                       param=f"{where}.{field}.url")


def placeholder_content(messages: list[dict]) -> list[dict]:
    """The messages with each media part replaced by its placeholder part (`{"type":
    "image"}`), so the template sees where the media goes but not its (large) URL or data."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": [
                {"type": MEDIA_PARTS[part["type"]]}
                if isinstance(part, dict) and part.get("type") in MEDIA_PARTS else part
                for part in content]}
        out.append(message)
    return out


def _load_media(part: MediaPart, limits: MediaLimits) -> MediaArray:
    """Fetch and decode one part into the array the engine gets (blocking: run in a pool)."""
    return MediaArray.of(load_part(part.part, limits, part.where, part.video_fps))


async def decode_media(parts: list[MediaPart], limits: MediaLimits,
                       executor: Executor | None) -> list[MediaArray]:
    """Every part fetched and decoded at once in `executor`, off the event loop; a part
    that cannot be used is a 400 naming it (the message says which field and why)."""
    loop = asyncio.get_running_loop()

    async def one(part: MediaPart) -> MediaArray:
        try:
            return await loop.run_in_executor(executor, _load_media, part, limits)
        except MediaError as error:
            raise APIError(400, str(error), param=part.where, code="invalid_value") from None

    return list(await asyncio.gather(*(one(part) for part in parts)))


@dataclass
class ChatPlan:
    prompt_token_ids: list[int]
    params: SamplingParams
    parse_reasoning: bool
    parse_tools: bool
    tools: list[dict] | None
    # False when the prompt closed the reasoning block (thinking disabled by the template).
    thinking: bool = True
    # The media parts to decode, in prompt order; their decoded arrays go in `media`.
    media_parts: list[MediaPart] = dataclasses.field(default_factory=list)
    media: list[MediaArray] = dataclasses.field(default_factory=list)


def plan_chat(request: ChatCompletionRequest, tokenizer, ready: EngineReady,
              options: ServerOptions) -> ChatPlan:
    check_model(request.model, options)
    media_parts = check_media(request.messages, ready, options.limit_mm_per_prompt,
                              video_fps_for(request.mm_processor_kwargs, ready, options))
    tools = [t.model_dump() for t in request.tools] if request.tools else None
    choice = request.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise APIError(400, "`tool_choice` needs `tools`", param="tool_choice")
    if choice == "auto" and tools and not (options.enable_auto_tool_choice
                                           and options.tool_call_parser):
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                            "--tool-call-parser", param="tool_choice")
    structured = structured_output_for(request, ready)
    if choice == "required" or not isinstance(choice, str):
        if structured is not None:
            raise APIError(400, f"`{structured.field_name}` cannot be combined with a forced "
                                "tool call", param=structured.field_name)
        functions = [t["function"] for t in tools]
        if not isinstance(choice, str):
            functions = [f for f in functions if f["name"] == choice.function.name]
            if not functions:
                raise APIError(400, f"`tool_choice` names {choice.function.name!r}, which is "
                                    "not among `tools`", param="tool_choice")
        with invalid_request_as_400():
            structured = StructuredOutput.for_tools(
                functions, parallel=choice == "required" and request.parallel_tool_calls,
                max_bytes=ready.max_grammar_bytes)
    elif choice == "auto" and structured is None:
        with invalid_request_as_400():
            structured = strict_tool_calls(tools, request.parallel_tool_calls,
                                           ready.max_grammar_bytes)
    prompt = render_chat(request.messages, without_strict(tools) if choice != "none" else None,
                         request.add_generation_prompt, request.chat_template_kwargs,
                         tokenizer, ready, options)
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = _params(request, prompt, max_tokens, ready, options,
                     (request.top_logprobs or 0) if request.logprobs else None)
    if media_parts and max_tokens is None:
        # The rest of the context after the prompt with its media expanded, which only the
        # engine knows (it also refuses a max_tokens that does not fit there).
        params.max_tokens = None
    reasoning = options.reasoning_parser == "muse"
    if structured is not None and reasoning:
        # As in vLLM, the grammar constrains the reply after its reasoning block (from the
        # start when the prompt closed the block: the engine checks the prompt's tail).
        structured = structured.after_reasoning()
    params.structured_output = structured
    return ChatPlan(prompt, params, parse_reasoning=reasoning,
                    parse_tools=choice != "none" and (options.tool_call_parser == "muse"
                                                      or structured is not None
                                                      and structured.kind == "tool_calls"),
                    tools=tools, thinking=not reasoning_closed_in_prompt(prompt),
                    media_parts=media_parts)


def reasoning_closed_in_prompt(prompt: list[int]) -> bool:
    """True when the reply's reasoning block is already closed by the prompt (the template
    writes `<think></think>` after the last `<|assistant|>` when thinking is disabled)."""
    for token in reversed(prompt):
        if token == THINK_END_ID:
            return True
        if token == ASSISTANT_ID:
            return False
    return False


def render_chat(messages: list, tools: list[dict] | None, add_generation_prompt: bool,
                template_kwargs: dict | None, tokenizer, ready: EngineReady,
                options: ServerOptions) -> list[int]:
    """The conversation's prompt token ids; any template error is a 400 (the request's)."""
    dumped = placeholder_content([m.model_dump(exclude_none=True) for m in messages])
    for message in dumped:
        if message["role"] == "developer":
            message["role"] = "system"
    check_text_length([text for _, text in json_strings([dumped, tools])], ready, options,
                      "messages")
    try:
        return tokenizer.apply_chat_template(
            dumped, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(template_kwargs or {}))
    except Exception as error:  # a template error is the request's fault
        reason = "it nests too deeply" if isinstance(error, RecursionError) else error
        raise APIError(400, f"cannot render the conversation: {reason}",
                       param="messages") from None


def check_text_length(texts: list[str], ready: EngineReady, options: ServerOptions,
                      param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit in the context whatever its tokens."""
    num_chars = sum(len(text) for text in texts)
    if num_chars > ready.max_model_len * options.max_token_bytes:
        raise APIError(400, f"the {param} hold {num_chars} characters: more than the "
                            f"{ready.max_model_len} tokens of this model's context could "
                            "hold", param=param, code="context_length_exceeded")


def _params(request, prompt: list[int], max_tokens: int | None, ready: EngineReady,
            options: ServerOptions, logprobs: int | None) -> SamplingParams:
    prompt_field = "messages" if hasattr(request, "messages") else "prompt"
    room = output_room(prompt, max_tokens, ready, prompt_field)
    params = checked_params(lambda: request.sampling_params(max_tokens or room, logprobs),
                            prompt, ready, prompt_field)
    _check_logprobs_size(params, len(prompt), getattr(request, "echo", False), options)
    return params


def output_room(prompt: list[int], max_tokens: int | None, ready: EngineReady,
                prompt_field: str, max_tokens_field: str = "max_tokens") -> int:
    """The tokens the output may have after `prompt`; a 400 when `max_tokens` asks more."""
    if len(prompt) >= ready.max_model_len:
        raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's maximum context "
                            f"length is {ready.max_model_len} tokens, prompt and output "
                            "together", param=prompt_field, code="context_length_exceeded")
    room = ready.max_model_len - len(prompt)
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"this model's maximum context length is {ready.max_model_len} "
                            f"tokens; the prompt has {len(prompt)} and {max_tokens_field} asks "
                            f"for {max_tokens}", param=max_tokens_field,
                       code="context_length_exceeded")
    return room


def checked_params(make: Callable[[], SamplingParams], prompt: list[int], ready: EngineReady,
                   prompt_field: str) -> SamplingParams:
    """The prompt's token ids and the sampling parameters `make` builds, checked (400s)."""
    try:
        validate_prompt(prompt, ready.vocab_size, ready.max_model_len)
        params = make()
        params.validate(ready.vocab_size)
    except InvalidRequestError as error:
        param = prompt_field if error.param == "prompt" else error.param
        raise APIError(400, str(error), param=param, code="invalid_value") from None
    return params


def _check_logprobs_size(params: SamplingParams, prompt_length: int, echo: bool,
                         options: ServerOptions) -> None:
    """Bound the logprob entries one response may carry (each is a JSON object)."""
    if params.logprobs is None:
        return
    per_token = 1 + params.logprobs
    entries = params.n * params.max_tokens * per_token + (prompt_length * per_token
                                                          if echo else 0)
    if entries > options.max_response_logprobs:
        raise APIError(400, f"this request asks for {entries} logprob entries (n x max_tokens "
                            f"x (1 + top logprobs){' + the echoed prompt' if echo else ''}); "
                            f"this server returns at most {options.max_response_logprobs} "
                            "(--max-response-logprobs): lower n, max_tokens or the number "
                            "of logprobs", param="max_tokens", code="invalid_value")


def completion_prompts(request: CompletionRequest, tokenizer) -> list[list[int]]:
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "`prompt` is empty", param="prompt")
    return prompts


def tokenize_prompts(prompts: list, tokenizer, ready: EngineReady, options: ServerOptions,
                     add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt (a string, or token ids already)."""
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text_length([prompt], ready, options, "prompt")
    return [tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str)
            else list(p) for p in prompts]


def plan_completion(request: CompletionRequest, prompt: list[int], ready: EngineReady,
                    options: ServerOptions) -> SamplingParams:
    check_model(request.model, options)
    if request.suffix is not None:
        raise APIError(400, "`suffix` is not supported", param="suffix")
    params = _params(request, prompt, request.max_tokens, ready, options, request.logprobs)
    params.structured_output = structured_output_for(request, ready)
    return params

"""`muse.LLM`: the offline API, shaped like vLLM's so users can switch by changing an import."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

from muse.chat_format import SPECIAL_TOKENS, THINK_END_ID, THINK_START_ID
from muse.detokenizer import IncrementalDetokenizer
from muse.engine.args import EngineArgs
from muse.engine.data_parallel import make_engine
from muse.engine.request import Request
from muse.engine.sampling_params import SamplingParams
from muse.engine.structured_output import strict_tool_calls, without_strict
from muse.lora.request import LoRARequest
from muse.multimodal.media import (AUDIO_PART_TYPES, DEFAULT_VIDEO_FPS, IMAGE_PART_TYPES,
                                   VIDEO_PART_TYPES, MediaError, MediaLimits, load_part,
                                   video_fps_of)
from muse.outputs import CompletionOutput, RequestOutput
from muse.presets import default_model
from muse.reasoning import split_reasoning

PromptType = Union[str, list[int], dict[str, Any]]
Message = dict[str, Any]
# True: a bar when stderr is a terminal; False: none; a tqdm-like factory: always, its way.
ProgressOption = Union[bool, Callable[..., Any]]
LoRAOption = Union[LoRARequest, Sequence[Union[LoRARequest, None]], None]

# Content part type -> media kind: parts whose URL or base64 data is fetched and decoded...
URL_PART_KINDS = {**{t: "image" for t in IMAGE_PART_TYPES},
                  **{t: "video" for t in VIDEO_PART_TYPES},
                  **{t: "audio" for t in AUDIO_PART_TYPES}}
# ...and parts that carry a decoded item (a PIL image, an array, a media.Video / Audio).
OBJECT_PART_KINDS = {"image_pil": "image", "image": "image", "video": "video", "audio": "audio"}

# A chat reply keeps its think tags through decoding so the reasoning can be split off; the
# other special tokens stay hidden as `skip_special_tokens` asks.
CHAT_HIDDEN_TOKEN_IDS = frozenset(range(len(SPECIAL_TOKENS))) - {THINK_START_ID, THINK_END_ID}


@dataclass
class _Group:
    """One prompt's samples while the engine runs them."""

    prompt: str | None
    samples: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    # Chat replies: whether the prompt left thinking on. None: a plain completion.
    thinking: bool | None


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: a checkpoint folder or a preset; by default the shipped model."""
        self.engine = make_engine(EngineArgs(model=model or default_model(), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's `LLM.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()

    # ---- LoRA adapters (with enable_lora=True) -------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter now (or a loaded name's new weights: the next version)."""
        self.engine.add_lora(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        self.engine.remove_lora(lora_name)
        return True

    def list_loras(self) -> list[str]:
        return [loaded.name for loaded in self.engine.list_loras()]

    # ---- prompts -------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the engine's worker processes (with `tensor_parallel_size` > 1); the engine
        cannot be used afterwards. Worker processes also end when this process exits."""
        self.engine.shutdown()

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        return None, list(prompt)

    def _detokenizer(self, params: SamplingParams, thinking: bool | None
                     ) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        hidden = CHAT_HIDDEN_TOKEN_IDS if thinking is not None and params.skip_special_tokens \
            else None
        return IncrementalDetokenizer(self.tokenizer, params, hidden)

    def _completion(self, request: Request, detokenizer: IncrementalDetokenizer | None,
                    thinking: bool | None) -> CompletionOutput:
        params = request.params
        finish_reason = request.finish_reason
        stop_reason: int | str | None = None
        stopped_by_token = finish_reason == "stop"
        if stopped_by_token:
            stop_reason = request.output_token_ids[-1]
        text, reasoning = "", None
        if detokenizer is not None:
            new = request.output_token_ids[detokenizer.num_tokens_seen:]
            delta = detokenizer.update(new, finished=request.is_finished,
                                       drop_last=stopped_by_token)
            if delta.stop is not None:
                stop_reason, finish_reason = delta.stop, "stop"
                # A stop string ends this sample as if it were a stop token, at the token
                # that completed it (a speculative step may have made more after it).
                self.engine.finish_request(request, "stop", len(request.output_token_ids)
                                           - len(new) + delta.num_tokens)
            # Only released text: the held-back tail may still turn out to start a stop
            # string, so partial outputs are always a prefix of the final text.
            text = detokenizer.text[:detokenizer.released]
            if thinking is not None:
                reasoning, text = split_reasoning(text, thinking)
        return CompletionOutput(
            index=request.sample_index,
            text=text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=stop_reason, reasoning_content=reasoning)

    def _output(self, group_id: str, group: _Group) -> RequestOutput:
        first = group.samples[0]
        if first.error is not None:
            raise first.error  # its grammar did not compile, as add_request would raise
        return RequestOutput(
            request_id=group_id, prompt=group.prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(s, d, group.thinking)
                     for s, d in zip(group.samples, group.detokenizers)],
            prompt_logprobs=first.prompt_logprobs if first.wants_prompt_logprobs else None,
            num_cached_tokens=first.num_cached_tokens,
            lora_name=first.lora.name if first.lora is not None else None,
            lora_version=first.lora.version if first.lora is not None else None)

    # ---- generation ----------------------------------------------------------------------
    def stream(self, prompts: PromptType | Sequence[PromptType],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               *, delta: bool = False,
               lora_request: LoRAOption = None) -> Iterator[RequestOutput]:
        """Yield a request's output every time it grows, until all are finished.

        By default each output is cumulative: `outputs[i].text`, `token_ids` and `logprobs`
        hold everything generated so far, and a request's last output equals what `generate`
        returns. With `delta=True` they hold only what is new since that request's previous
        output (`cumulative_logprob` stays cumulative), so printing each piece with
        `end=""` prints the whole text once.
        """
        return self._stream(prompts, sampling_params, delta=delta, thinking=None,
                            lora_request=lora_request)

    def _stream(self, prompts: PromptType | Sequence[PromptType],
                sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                delta: bool, thinking: bool | None,
                lora_request: LoRAOption = None) -> Iterator[RequestOutput]:
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError("give one lora_request, or one per prompt")
        groups: dict[str, _Group] = {}
        sent: dict[tuple[str, int], tuple[int, int]] = {}
        try:
            for prompt, params, adapter in zip(prompts, sampling_params, lora_request):
                text, ids = self._prompt_ids(prompt)
                group_id = str(next(self._ids))
                extra = {key: prompt[key] for key in ("multi_modal_data", "cache_salt")
                         if isinstance(prompt, dict) and prompt.get(key) is not None}
                samples = self.engine.add_request(group_id, ids, params, lora_request=adapter,
                                                  **extra)
                groups[group_id] = _Group(text, samples,
                                          [self._detokenizer(params, thinking) for _ in samples],
                                          thinking)
            reported: set[str] = set()
            while len(reported) < len(groups):
                changed = {r.group_id for r in self.engine.step()}
                for group_id in changed:
                    output = self._output(group_id, groups[group_id])
                    if output.finished:
                        reported.add(group_id)
                    yield _new_part(output, sent) if delta else output
                if not changed and not self.engine.has_unfinished():
                    break
        finally:
            for group_id in groups:
                self.engine.abort(group_id)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: ProgressOption = True,
                 lora_request: LoRAOption = None) -> list[RequestOutput]:
        """Final outputs in the order of the prompts.

        `lora_request`: the adapter to run with (`LoRARequest(name, id, path)`, one for all
        prompts or one per prompt; None: the base model). A name's adapter is read once; a
        new `lora_int_id` or path for a name loads its new weights.

        `use_tqdm`: True shows a progress bar on stderr when it is a terminal (so logs and
        pipes stay clean); False never; a tqdm-like factory such as `tqdm.tqdm` always shows
        the bar it makes.
        """
        return self._generate(prompts, sampling_params, use_tqdm, thinking=None,
                              lora_request=lora_request)

    def _generate(self, prompts: PromptType | Sequence[PromptType],
                  sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                  use_tqdm: ProgressOption, thinking: bool | None,
                  lora_request: LoRAOption = None) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        bar = _progress_bar(use_tqdm, total=len(prompts))
        num_output_tokens = 0
        final: dict[str, RequestOutput] = {}
        try:
            for output in self._stream(prompts, sampling_params, delta=False,
                                       thinking=thinking, lora_request=lora_request):
                final[output.request_id] = output
                if bar is not None and not bar.disable and output.finished:
                    num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = bar.format_dict["elapsed"]
                    if elapsed > 0:
                        bar.set_postfix_str(f"{num_output_tokens / elapsed:.0f} output tok/s",
                                            refresh=False)
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [final[k] for k in sorted(final, key=int)]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, use_tqdm: ProgressOption = True,
             chat_template_kwargs: dict[str, Any] | None = None,
             media_limits: MediaLimits | None = None,
             lora_request: LoRAOption = None,
             mm_processor_kwargs: dict[str, Any] | None = None,
             **template_kwargs: Any) -> list[RequestOutput]:
        """Replies to one conversation or a list of them.

        Each reply's `<think>` block is split off as vLLM's reasoning parsers do:
        `outputs[i].reasoning_content` holds the reasoning (None without a think block) and
        `outputs[i].text` the answer only. `enable_thinking=False` (a template keyword, here
        or in `chat_template_kwargs`) ends the prompt with an empty think block; text the
        model still writes before a `</think>` is then reasoning too.

        Content parts may carry media, as in the OpenAI server: `image_url`, `video_url`,
        `audio_url` (data:, http(s): or, with `media_limits.allowed_local_media_path`, file:
        URLs) and `input_audio` (base64), fetched and decoded under `media_limits` (default:
        `MediaLimits()`); or decoded items, as in vLLM: `{"type": "image_pil", "image_pil":
        img}` (a PIL image or uint8 [H, W, 3] array), `{"type": "image", "image": ...}`,
        `{"type": "video", "video": ...}` (uint8 [T, H, W, 3] frames, (frames, timestamps)
        or a `media.Video`), `{"type": "audio", "audio": ...}` (a float waveform at 24 kHz
        or a `media.Audio`). They go to the engine as `multi_modal_data`; a part that cannot
        be used raises a `MediaError` (a ValueError) naming it. `mm_processor_kwargs`
        (vLLM's): `{"fps": N}` samples the videos fetched from URLs at N frames a second
        (default: the model's `video_fps`).

        `tools` are OpenAI tool entries, offered as under `tool_choice` "auto"; when a
        function says `"strict": true`, every call the reply writes is checked as it is
        written (an offered name, and the strict functions' schemas), as in the server, unless
        `sampling_params` brings its own `structured_output`.
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        constraint = strict_tool_calls(tools, parallel=True)
        if constraint is not None:
            params = sampling_params or SamplingParams()
            if params.structured_output is None:
                sampling_params = dataclasses.replace(
                    params, structured_output=constraint.after_reasoning())
        tools = without_strict(tools)
        template_kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        limits = media_limits or MediaLimits()
        video_fps = self._video_fps(mm_processor_kwargs)
        prompts = []
        for number, conversation in enumerate(conversations):
            prefix = f"conversations[{number}]." if len(conversations) > 1 else ""
            conversation, media = _chat_media(conversation, limits, prefix, video_fps)
            prompt: dict[str, Any] = {"prompt_token_ids": self.tokenizer.apply_chat_template(
                conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                tokenize=True, **template_kwargs)}
            if media:
                prompt["multi_modal_data"] = media
            prompts.append(prompt)
        # The template only closes the think block when it opens the assistant's turn.
        thinking = bool(template_kwargs.get("enable_thinking", True)) or not add_generation_prompt
        return self._generate(prompts, sampling_params, use_tqdm, thinking=thinking,
                              lora_request=lora_request)


    def _video_fps(self, mm_processor_kwargs: dict[str, Any] | None) -> float:
        """A chat's video sampling rate: `mm_processor_kwargs["fps"]` or the model's."""
        fps = video_fps_of(mm_processor_kwargs or {})
        return fps if fps is not None else self.engine.replicas[0].video_fps()


def _chat_media(messages: list[Message], limits: MediaLimits, prefix: str = "",
                video_fps: float = DEFAULT_VIDEO_FPS) -> tuple[list[Message], dict[str, list]]:
    """The messages with each media part replaced by its placeholder part (`{"type":
    "image"}`), and the media by kind in prompt order (vLLM's `multi_modal_data`)."""
    media: dict[str, list] = {}
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in URL_PART_KINDS or kind in OBJECT_PART_KINDS:
                where = f"{prefix}messages[{i}].content[{j}]"
                item, kind = _media_item(part, kind, limits, where, video_fps)
                media.setdefault(kind, []).append(item)
                part = {"type": kind}
            parts.append(part)
        out.append({**message, "content": parts})
    return out, media


def _media_item(part: dict, part_type: str, limits: MediaLimits, where: str,
                video_fps: float) -> tuple[Any, str]:
    """(the decoded item, its kind) of one media part."""
    if part_type in OBJECT_PART_KINDS:
        item = part.get(part_type)
        if item is None:
            raise MediaError(where, f"a {part_type!r} part needs the item under "
                                    f"{part_type!r}")
        return item, OBJECT_PART_KINDS[part_type]
    return load_part(part, limits, where, video_fps), URL_PART_KINDS[part_type]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (text, token ids or a dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                           and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def _new_part(output: RequestOutput, sent: dict[tuple[str, int], tuple[int, int]]
              ) -> RequestOutput:
    """What is new in a cumulative output; `sent` holds the text and token counts given so
    far per (request, sample) and is updated."""
    parts = []
    for completion in output.outputs:
        key = (output.request_id, completion.index)
        num_chars, num_tokens = sent.get(key, (0, 0))
        sent[key] = (len(completion.text), len(completion.token_ids))
        parts.append(dataclasses.replace(
            completion, text=completion.text[num_chars:],
            token_ids=completion.token_ids[num_tokens:],
            logprobs=completion.logprobs[num_tokens:] if completion.logprobs is not None
            else None))
    return dataclasses.replace(output, outputs=parts)


def _progress_bar(use_tqdm: ProgressOption, total: int) -> Any:
    if use_tqdm is False:
        return None
    from tqdm import tqdm

    options = {"total": total, "desc": "Processed prompts", "unit": "prompt",
               "dynamic_ncols": True}
    if callable(use_tqdm):
        return use_tqdm(**options)
    # disable=None: tqdm stays silent unless stderr is a terminal.
    return tqdm(**options, disable=None)

"""The OpenAI request bodies muse accepts (pydantic), and their mapping to SamplingParams.

Unknown fields are ignored, as the OpenAI API and vLLM do; known fields are type-checked and
range-checked so a bad value is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from muse.engine.sampling_params import SamplingParams
from muse.multimodal.media import MAX_VIDEO_FPS


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    # As in vLLM: every chunk carries the usage so far, and a chunk is sent for every step
    # that generated tokens even when they add no text, so clients can time each token.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(OpenAIModel):
    """vLLM's `structured_outputs` (an extra field): exactly one of a JSON schema (`json`, an
    object or its JSON text), a regular expression, a list of strings to choose from, an
    EBNF grammar, or any JSON object."""

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Any] = None  # refused: not supported


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: Optional[str] = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                 "properties": {}})
    # OpenAI's switch for schema-following arguments; under tool_choice "auto" a call to any
    # offered tool is then checked as it is written (SGLang's behaviour).
    strict: Optional[bool] = None


class MMProcessorKwargs(BaseModel):
    """vLLM's `mm_processor_kwargs`: how this request's media are prepared. `fps`: the frames
    a second its videos are sampled at (the model's `video_fps` when absent), up to the
    frame limits. Other keys are refused (a 400 naming them), not ignored."""

    model_config = ConfigDict(extra="forbid")
    fps: Optional[float] = Field(None, gt=0, le=MAX_VIDEO_FPS)


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class SamplingFields(OpenAIModel):
    """Fields shared by chat and completions requests."""

    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1, le=2**31 - 1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None  # range-checked against the vocabulary
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: Optional[str] = None
    # vLLM's: requests share prefix-cache blocks only with requests of the same salt.
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=1024)
    # vLLM's, for disaggregated serving (see muse.disagg): set by `muse router`.
    kv_transfer_params: Optional[dict[str, Any]] = None
    # Structured output beside `response_format`: vLLM's `structured_outputs`, and the
    # `guided_*` fields of its earlier versions.
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        default_temperature: float = 1.0) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = None
        if self.logit_bias:
            try:
                bias = {int(token): value for token, value in self.logit_bias.items()}
            except ValueError:
                from muse.engine.sampling_params import InvalidRequestError

                raise InvalidRequestError("`logit_bias` keys must be token ids",
                                          param="logit_bias") from None
        return SamplingParams(
            n=self.n,
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=bias, seed=self.seed,
            stop=stop, stop_token_ids=list(self.stop_token_ids or []), max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output)


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    mm_processor_kwargs: Optional[MMProcessorKwargs] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None


class TokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    mm_processor_kwargs: Optional[MMProcessorKwargs] = None
    tools: Optional[list[Tool]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: list[int]


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's `/v1/load_lora_adapter` body; `load_inplace` replaces a loaded name's weights
    (the next version: how a trainer pushes a new adapter)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: Optional[int] = None  # accepted as vLLM does; the name decides

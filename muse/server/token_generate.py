"""`POST /generate`: token ids in, token ids and their log-probs out (SGLang's native route,
the one RL stacks such as verl and slime call for rollouts).

The request carries `input_ids` (or `text`) and SGLang's `sampling_params`; the reply carries
the engine's own `output_ids` (never re-tokenized text), `meta_info.output_token_logprobs` as
[logprob, token_id, null] triples when `return_logprob` is set, the finish reason, and
`weight_version`: the LoRA adapter version the request ran with (`lora_path` names a loaded
adapter, as in SGLang), or "base". A list of results when `n` > 1.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import Field

from muse.engine.sampling_params import SamplingParams
from muse.server.errors import APIError
from muse.server.generation import GenerationState, SampleUpdate
from muse.server.messages import EngineReady
from muse.server.protocol import OpenAIModel
from muse.server.serving import ServerOptions, checked_params, output_room


class GenerateSamplingParams(OpenAIModel):
    """SGLang's sampling parameter names."""

    max_new_tokens: Optional[int] = Field(None, ge=1)
    min_new_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=128)
    sampling_seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)


class GenerateRequest(OpenAIModel):
    input_ids: Optional[list[int]] = None
    text: Optional[str] = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    lora_path: Optional[str] = None  # a loaded adapter's name
    stream: bool = False
    rid: Optional[str] = None

    def prompt(self, tokenizer) -> list[int]:
        if (self.input_ids is None) == (self.text is None):
            raise APIError(400, "give exactly one of `input_ids` and `text`", param="input_ids")
        if self.stream:
            raise APIError(400, "`stream` is not supported on /generate; use "
                                "/v1/completions for streams", param="stream")
        if self.input_ids is not None:
            if not self.input_ids:
                raise APIError(400, "`input_ids` is empty", param="input_ids")
            return list(self.input_ids)
        return tokenizer.encode(self.text, add_special_tokens=True)

    def sampling(self, max_tokens: int) -> SamplingParams:
        given = self.sampling_params
        stop = [given.stop] if isinstance(given.stop, str) else list(given.stop or [])
        return SamplingParams(
            n=given.n, temperature=given.temperature, top_p=given.top_p,
            top_k=max(given.top_k, 0), min_p=given.min_p,
            presence_penalty=given.presence_penalty, frequency_penalty=given.frequency_penalty,
            repetition_penalty=given.repetition_penalty, seed=given.sampling_seed, stop=stop,
            stop_token_ids=list(given.stop_token_ids or []), max_tokens=max_tokens,
            min_tokens=given.min_new_tokens, ignore_eos=given.ignore_eos,
            logprobs=0 if self.return_logprob else None,
            skip_special_tokens=given.skip_special_tokens)


def plan_generate(request: GenerateRequest, tokenizer, ready: EngineReady,
                  options: ServerOptions) -> tuple[list[int], SamplingParams, str | None]:
    """The prompt's ids, the checked sampling parameters and the adapter to run with."""
    lora_name = request.lora_path
    if lora_name is not None and lora_name not in options.lora_adapters:
        raise APIError(404, f"no adapter named {lora_name!r} is loaded", param="lora_path",
                       code="model_not_found")
    prompt = request.prompt(tokenizer)
    field = "input_ids" if request.input_ids is not None else "text"
    max_new_tokens = request.sampling_params.max_new_tokens
    room = output_room(prompt, max_new_tokens, ready, field, "sampling_params.max_new_tokens")
    params = checked_params(lambda: request.sampling(max_new_tokens or room), prompt, ready,
                            field)
    return prompt, params, lora_name


def generate_reply(request_id: str, updates: dict[int, list[SampleUpdate]],
                   state: GenerationState, return_logprob: bool) -> list[dict[str, Any]]:
    """One SGLang-shaped result per sample, from the sample's updates in order."""
    results = []
    for index in sorted(updates):
        parts = updates[index]
        token_ids = [t for part in parts for t in part.token_ids]
        finish, matched = parts[-1].finish_reason, parts[-1].stop_reason
        meta: dict[str, Any] = {
            "id": request_id if len(updates) == 1 else f"{request_id}-{index}",
            "finish_reason": {"type": finish, "matched": matched} if finish else None,
            "prompt_tokens": state.num_prompt_tokens,
            "completion_tokens": len(token_ids),
            "cached_tokens": state.num_cached_tokens,
            "weight_version": "base" if state.lora_version is None else str(state.lora_version),
        }
        if return_logprob:
            meta["output_token_logprobs"] = [[entry.logprob, entry.token_id, None]
                                             for part in parts for entry in part.logprobs]
        results.append({"text": "".join(part.text for part in parts), "output_ids": token_ids,
                        "meta_info": meta})
    return results

"""`muse.LLM`: the offline API, shaped like vLLM's so users can switch by changing an import."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, Union

from muse.engine.args import EngineArgs
from muse.presets import default_model
from muse.engine.engine import EngineCore
from muse.detokenizer import IncrementalDetokenizer
from muse.engine.request import Request
from muse.engine.sampling_params import SamplingParams
from muse.outputs import CompletionOutput, RequestOutput

PromptType = Union[str, list[int], dict[str, Any]]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`model`: a checkpoint folder or a preset; by default the shipped model."""
        self.engine = EngineCore(EngineArgs(model=model or default_model(), **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    # ---- prompts -------------------------------------------------------------------------
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

    def _completion(self, request: Request, detokenizer: IncrementalDetokenizer | None
                    ) -> CompletionOutput:
        params = request.params
        finish_reason = request.finish_reason
        stop_reason: int | str | None = None
        stopped_by_token = finish_reason == "stop"
        if stopped_by_token:
            stop_reason = request.output_token_ids[-1]
        if detokenizer is not None:
            new = request.output_token_ids[detokenizer.num_tokens_seen:]
            delta = detokenizer.update(new, finished=request.is_finished,
                                       drop_last=stopped_by_token)
            if delta.stop is not None:
                stop_reason, finish_reason = delta.stop, "stop"
                if not request.is_finished:
                    # A stop string ends this sample as if it were a stop token.
                    self.engine.finish_request(request, "stop")
        return CompletionOutput(
            index=request.sample_index,
            text=detokenizer.text if detokenizer is not None else "",
            token_ids=list(request.output_token_ids),
            cumulative_logprob=request.cumulative_logprob if params.logprobs is not None else None,
            logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=stop_reason)

    def _output(self, group_id: str, prompt: str | None, samples: list[Request],
                detokenizers: list[IncrementalDetokenizer | None]) -> RequestOutput:
        first = samples[0]
        return RequestOutput(
            request_id=group_id, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
            outputs=[self._completion(s, d) for s, d in zip(samples, detokenizers)],
            prompt_logprobs=first.prompt_logprobs if first.wants_prompt_logprobs else None,
            num_cached_tokens=first.num_cached_tokens)

    # ---- generation ----------------------------------------------------------------------
    def stream(self, prompts: PromptType | Sequence[PromptType],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Yield a request's cumulative output every time it grows, until all are finished."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        groups: dict[str, tuple[str | None, list[Request], list]] = {}
        try:
            for prompt, params in zip(prompts, sampling_params):
                text, ids = self._prompt_ids(prompt)
                group_id = str(next(self._ids))
                samples = self.engine.add_request(group_id, ids, params)
                detokenizers = [IncrementalDetokenizer(self.tokenizer, params)
                                if self.tokenizer is not None else None for _ in samples]
                groups[group_id] = (text, samples, detokenizers)
            reported: set[str] = set()
            while len(reported) < len(groups):
                changed = {r.group_id for r in self.engine.step()}
                for group_id in changed:
                    output = self._output(group_id, *groups[group_id])
                    if output.finished:
                        reported.add(group_id)
                    yield output
                if not changed and not self.engine.has_unfinished():
                    break
        finally:
            for group_id in groups:
                self.engine.abort(group_id)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Final outputs in the order of the prompts."""
        final: dict[str, RequestOutput] = {}
        for output in self.stream(prompts, sampling_params):
            final[output.request_id] = output
        return [final[k] for k in sorted(final, key=int)]

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | None = None, tools: list[dict] | None = None,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": self.tokenizer.apply_chat_template(
            conversation, tools=tools, add_generation_prompt=add_generation_prompt,
            tokenize=True, **template_kwargs)} for conversation in conversations]
        return self.generate(prompts, sampling_params)

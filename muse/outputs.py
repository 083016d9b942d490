"""What the offline API returns, shaped like vLLM's outputs so code can switch engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from muse.engine.request import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Chat replies only: the think block's text, None when there is none; `text` is then the
    # answer alone.
    reasoning_content: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # The LoRA adapter's name and version the request ran with (None: the base model): the
    # weight version a rollout was sampled with.
    lora_name: str | None = None
    lora_version: int | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

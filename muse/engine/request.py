"""One generation request as the engine core sees it: token ids, progress and state.

Two counters drive everything: `num_tokens` (known) and `num_computed_tokens` (whose KV is in
the cache). Prefill, chunked prefill, prefix-cache hits and decode all just advance the second.
With the overlapped schedule a token can be known only by count for one step: sampled by the
step still running on the device, its value is read back after the next step is launched.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from muse.engine.errors import InvalidRequestError
from muse.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class TokenLogprobs:
    """Log-probability of one chosen token and the top alternatives at that position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


_arrival = itertools.count()


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    group_id: str = ""  # the client's request id; differs from request_id when n > 1
    # Index of this sample among the `n` of its prompt; siblings wait for the first's prefill.
    sample_index: int = 0
    parent: Request | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    generator: torch.Generator | None = None
    grammar: Any = None  # its RequestGrammar when the output is constrained
    # Why the request failed after admission (its grammar did not compile); it then finishes
    # with reason "error" and the server answers with this error instead of output.
    error: InvalidRequestError | None = None
    # Output tokens sampled by steps whose results are not read back yet: counted in
    # `num_tokens`, not yet in `output_token_ids` (two for a moment: the engine launches a
    # step before it reads back the one before).
    num_pending_tokens: int = 0
    # A pending token ends the request by length whatever its value: nothing to schedule.
    final_token_pending: bool = False
    # Speculative decoding: draft tokens proposed for the positions after the known ones,
    # verified by the next step (never with a pending token: speculation reads each step
    # back before the next).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_token_probs: torch.Tensor | None = None  # [drafts, vocab] q; None: one-hot drafts
    # Drafts still on the device: row `index` of `tensor` [requests, G] holds them, and
    # spec_token_ids only placeholders of their count (the step's inputs take the real ones
    # on the device, and the verified tokens come back with the step's result).
    spec_token_device: tuple[torch.Tensor, int] | None = None
    # Images, video and audio of the prompt (`muse.multimodal.processor.ProcessedMedia`):
    # `prompt_token_ids` are the processor's expanded ids, each item's spans in them.
    media: list = field(default_factory=list)
    # Separates this request's prefix-cache entries from those of other salts (vLLM's
    # `cache_salt`: tenants that must not share cached prompts).
    cache_salt: str | None = None
    # The LoRA adapter it runs with (`muse.lora.manager.AdapterUse`); None: the base model.
    lora: Any = None
    # A prefill instance's request for a decode instance (`kv_transfer_params`
    # "do_remote_decode"): its blocks are held after it finishes, until pulled or timed out.
    hold_kv_for_transfer: bool = False

    def __post_init__(self) -> None:
        self.group_id = self.group_id or self.request_id

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without copying the whole sequence (a
        step reads a few tokens of sequences that can be a million long). A pending token
        reads as 0: the runner fills its value in on the device; positions past the known
        tokens read as the request's drafts (`spec_token_ids`)."""
        known = self.num_tokens - self.num_pending_tokens
        if end > known:
            # Past the known tokens: this step's drafts, then pending tokens as 0.
            first = max(start, known)
            drafts = self.spec_token_ids[first - known:end - known]
            head = self.token_ids(start, known) if start < known else []
            return head + drafts + [0] * (end - first - len(drafts))
        prompt, num_prompt = self.prompt_token_ids, len(self.prompt_token_ids)
        if end <= num_prompt:
            return prompt[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return prompt[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def needs_token_values(self) -> bool:
        """Sampling its next token reads the values of its earlier ones (grammar state,
        repetition penalties), so its step must be read back before the next is launched."""
        params = self.params
        return (self.grammar is not None or params.repetition_penalty != 1.0
                or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0)

    def add_pending_token(self, max_model_len: int) -> None:
        """Count a token the device sampled whose value is not read back yet."""
        self.num_pending_tokens += 1
        self.final_token_pending = self._length_reached(self.num_output_tokens, max_model_len)

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        if self.num_pending_tokens:
            self.num_pending_tokens -= 1
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep the first `num_output_tokens` output tokens (a stop string met earlier)."""
        if num_output_tokens >= len(self.output_token_ids):
            return
        del self.output_token_ids[num_output_tokens:]
        if self.output_logprobs:
            del self.output_logprobs[num_output_tokens:]
            self.cumulative_logprob = sum(lp.logprob for lp in self.output_logprobs)

    def check_stop(self, max_model_len: int) -> str | None:
        """The finish reason after the latest token read back, or None to keep going."""
        last = self.output_token_ids[-1]
        num_output = len(self.output_token_ids)
        if num_output >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                return "stop"
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return "stop"
        return "length" if self._length_reached(num_output, max_model_len) else None

    def _length_reached(self, num_output: int, max_model_len: int) -> bool:
        max_tokens = self.params.max_tokens
        return ((max_tokens is not None and num_output >= max_tokens)
                or self.num_prompt_tokens + num_output >= max_model_len)

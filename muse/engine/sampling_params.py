"""How one request wants its tokens chosen.

Checked when built and again, against the vocabulary, at admission; never inside a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from muse.engine.errors import InvalidRequestError
from muse.engine.structured_output import StructuredOutput

__all__ = ["InvalidRequestError", "SamplingParams", "validate_prompt"]


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Field names and meanings follow the OpenAI API and vLLM, so users can switch."""

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0  # 0 (or -1) = no limit
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Accept the spellings vLLM accepts: a single stop string, None for no stops, -1 for
        # no top-k limit.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        # A mistake shows where the params are built, as in vLLM, not at the first request.
        self._check_fields()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _check(self, ok: bool, name: str, allowed: str) -> None:
        if not ok:
            raise InvalidRequestError(
                f"`{name}` must be {allowed}, got {getattr(self, name)!r}", param=name)

    def _check_fields(self) -> None:
        """The checks that need no vocabulary."""
        check = self._check
        check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]")
        check(_is_number(self.temperature) and 0.0 <= self.temperature <= 100.0,
              "temperature", "in [0, 100]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
              "0, -1 or a positive integer")
        check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
              "repetition_penalty", "in (0, 10]")
        check(_is_number(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty", "in [-2, 2]")
        check(_is_number(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty", "in [-2, 2]")
        check(self.max_tokens is None
              or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
              "max_tokens", "null or an integer >= 1")
        check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens
              and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
              "min_tokens", "an integer in [0, max_tokens]")
        check(self.logprobs is None or (isinstance(self.logprobs, int)
                                        and 0 <= self.logprobs <= MAX_LOGPROBS),
              "logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]")
        check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                               and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
              "prompt_logprobs", f"null or an integer in [0, {MAX_LOGPROBS}]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "null or an integer")
        check(isinstance(self.stop_token_ids, list)
              and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "a list of token ids (integers >= 0)")
        check(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
              "stop", "non-empty strings")
        for token, bias in (self.logit_bias or {}).items():
            if not (isinstance(token, int) and token >= 0):
                raise InvalidRequestError(f"`logit_bias` key {token!r} is not a token id",
                                          param="logit_bias")
            if not (_is_number(bias) and -100.0 <= bias <= 100.0):
                raise InvalidRequestError(f"`logit_bias` value for token {token} must be in "
                                          f"[-100, 100], got {bias!r}", param="logit_bias")

    def validate(self, vocab_size: int) -> None:
        """All checks, including those against the model's vocabulary; run at admission.

        The field checks run again: a caller may have assigned a field since construction.
        """
        self._check_fields()
        self._check(all(t < vocab_size for t in self.stop_token_ids),
                    "stop_token_ids", f"token ids in [0, {vocab_size})")
        for token in self.logit_bias or {}:
            if token >= vocab_size:
                raise InvalidRequestError(f"`logit_bias` key {token!r} is not a token id in "
                                          f"[0, {vocab_size})", param="logit_bias")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Refuse prompts the engine cannot serve, naming the problem."""
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    bad = [t for t in prompt_token_ids
           if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size}); "
                                  f"got {bad[:5]}", param="prompt")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_token_ids)} tokens; this model's maximum context "
            f"length is {max_model_len} tokens, prompt and output together", param="prompt")


def check_output_room(prompt_token_ids: list[int], params: SamplingParams,
                      max_model_len: int) -> None:
    """Refuse a `max_tokens` (or `min_tokens`) the context cannot hold after the prompt.
    The server checks text prompts itself; a prompt with media is only known at its full
    length once the engine has expanded the placeholders."""
    room = max_model_len - len(prompt_token_ids)
    for name in ("max_tokens", "min_tokens"):
        wanted = getattr(params, name)
        if wanted is not None and wanted > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {max_model_len} tokens; the prompt "
                f"has {len(prompt_token_ids)} with its media expanded and {name} asks for "
                f"{wanted}", param=name)

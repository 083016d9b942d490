"""What the front end and the engine core say to each other (msgspec structs)."""

from __future__ import annotations

import msgspec

from muse.engine.request import TokenLogprobs
from muse.engine.sampling_params import SamplingParams
from muse.engine.structured_output import DEFAULT_MAX_GRAMMAR_BYTES


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag=True):
    request_id: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class SampleDelta(msgspec.Struct, tag=True):
    """New tokens of sample `index` of a request since the last delta."""

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class RequestFailed(msgspec.Struct, tag=True):
    request_id: str
    message: str
    param: str | None = None
    status: int = 400


class EngineStats(msgspec.Struct, tag=True):
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # Speculative decoding (muse.speculative.metrics), summed since start; empty without it.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []


class EngineReady(msgspec.Struct, tag=True):
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    eos_token_ids: list[int]
    # The engine's limit on a schema's (or the tools') JSON text, so the front end refuses
    # larger ones before queueing them.
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES


class EngineDead(msgspec.Struct, tag=True):
    message: str


ToEngine = AddRequest | AbortRequest | Shutdown
FromEngine = list[SampleDelta | RequestFailed | EngineStats | EngineReady | EngineDead]

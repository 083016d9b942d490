"""One request's life in the front end: engine deltas -> text deltas, stop strings, metrics."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from muse.detokenizer import IncrementalDetokenizer
from muse.engine.request import TokenLogprobs
from muse.engine.sampling_params import SamplingParams
from muse.server.engine_client import EngineClient
from muse.server.messages import MediaArray
from muse.server.metrics import ServerMetrics


@dataclass
class SampleUpdate:
    """What sample `index` added since its last update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationState:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    texts: dict[int, str] = field(default_factory=dict)
    outcome: str | None = None  # set when the generation did not finish: "abort" or "error"
    lora_version: int | None = None  # the adapter version it ran with (a rollout's)


def kv_transfer_reply(client: EngineClient, request_params: dict | None, request_id: str
                      ) -> dict | None:
    """What a prefill instance answers a `do_remote_decode` request with: where a decode
    instance pulls the prompt's blocks from (vLLM's `kv_transfer_params` reply)."""
    address = client.ready.kv_producer
    if address is None or not (request_params or {}).get("do_remote_decode"):
        return None
    return {"do_remote_prefill": True, "remote_host": address[0], "remote_port": address[1],
            "remote_request_id": request_id}


async def generate(client: EngineClient, tokenizer, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams, metrics: ServerMetrics, state: GenerationState,
                   hidden_token_ids: frozenset[int] | None = None,
                   media: list[MediaArray] | None = None,
                   cache_salt: str | None = None,
                   kv_transfer_params: dict | None = None,
                   lora_name: str | None = None) -> AsyncIterator[SampleUpdate]:
    """Updates of every sample until all finish; stop strings end a sample early.

    A generation left unfinished marks `state.outcome` "abort" (the client left) or "error";
    the HTTP request is then counted with that outcome (see request_guards.CountRequests).
    """
    arrival = time.monotonic()
    last_token_time: float | None = None
    detokenizers = {i: IncrementalDetokenizer(tokenizer, params, hidden_token_ids)
                    for i in range(params.n)}
    unfinished = set(range(params.n))
    status = "abort"
    deltas = client.generate(request_id, prompt_token_ids, params, media, cache_salt,
                             kv_transfer_params, lora_name)
    try:
        async for delta in deltas:
            metrics.generation_tokens.inc(len(delta.token_ids))
            if delta.index not in unfinished:
                continue  # a sample already ended by a stop string
            now = time.monotonic()
            if last_token_time is None:
                metrics.time_to_first_token.observe(now - arrival)
                state.num_prompt_tokens = delta.num_prompt_tokens
                state.num_cached_tokens = delta.num_cached_tokens
                state.lora_version = delta.lora_version
            elif delta.token_ids:
                for _ in delta.token_ids:
                    metrics.inter_token_latency.observe((now - last_token_time)
                                                        / len(delta.token_ids))
            last_token_time = now
            if delta.prompt_logprobs is not None:
                state.prompt_logprobs = delta.prompt_logprobs
            finish, stop_reason = delta.finish_reason, None
            if finish == "stop" and delta.token_ids:
                stop_reason = delta.token_ids[-1]
            detokenizer = detokenizers[delta.index]
            text = detokenizer.update(delta.token_ids, finished=finish is not None,
                                      drop_last=finish == "stop")
            token_ids, logprobs = delta.token_ids, delta.logprobs or []
            if text.stop is not None:
                finish, stop_reason = "stop", text.stop
                # Tokens after the one that completed the stop string are not output.
                token_ids, logprobs = token_ids[:text.num_tokens], logprobs[:text.num_tokens]
            state.num_output_tokens += len(token_ids)
            state.texts[delta.index] = detokenizer.text
            if finish is not None:
                unfinished.discard(delta.index)
                metrics.sample_finished(finish)
            yield SampleUpdate(delta.index, text.text, token_ids, logprobs, finish,
                               stop_reason)
            if not unfinished:
                status = "finished"
                break
    except Exception:
        status = "error"
        raise
    finally:
        metrics.prompt_tokens.inc(state.num_prompt_tokens)
        metrics.request_prompt_tokens.observe(state.num_prompt_tokens)
        metrics.request_generation_tokens.observe(state.num_output_tokens)
        metrics.e2e_latency.observe(time.monotonic() - arrival)
        for _ in unfinished:
            metrics.sample_finished("abort")
        if status != "finished" and state.outcome != "error":
            state.outcome = status
        # Samples a stop string ended are still running in the engine: leaving the engine's
        # stream (here or because the client went away) aborts them. Close it now rather than
        # when it is garbage collected, so the abort is never late.
        await deltas.aclose()

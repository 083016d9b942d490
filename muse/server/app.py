"""The FastAPI application: routes, errors, health and metrics.

Request guards (API key, body size and read time, counting) wrap the app as ASGI middleware
(request_guards.py). Parsing, chat-template rendering and tokenizing run in a thread pool,
so a large or slow request never holds up the event loop that serves the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException

import muse
from muse.server.chat import chat_completion
from muse.server.completions import completion
from muse.server.engine_client import EngineClient, EngineDeadError, RequestError
from muse.server.errors import APIError, error_response, validation_error_response
from muse.server.generation import GenerationState, generate
from muse.server.json_body import parse_body
from muse.server.messages import LoadLoRA, UnloadLoRA
from muse.server.metrics import ServerMetrics
from muse.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from muse.server.token_generate import GenerateRequest, generate_reply, plan_generate
from muse.server.request_guards import BufferedBody, CountRequests, RequireAPIKey
from muse.server.serving import (
    MediaPart,
    ServerOptions,
    check_media,
    check_model,
    default_body_limit,
    completion_prompts,
    decode_media,
    plan_chat,
    plan_completion,
    render_chat,
    tokenize_prompts,
    video_fps_for,
)
from muse.server.stats_logger import log_stats_while_running

logger = logging.getLogger("muse.server")
# Threads that parse bodies and tokenize prompts; more would only contend for the GIL.
PREPARE_THREADS = 4
# Threads that fetch and decode media parts: fetches wait on the network, and Pillow, PyAV
# and soundfile release the GIL while decoding, so more than PREPARE_THREADS pay off.
MEDIA_THREADS = 8


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, work):
    """Run `work`; if the client goes away first, cancel it (which aborts its generation)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.wait({task})  # its cleanup aborts the generation and counts it
        return Response(status_code=499)
    return task.result()


def build_app(client: EngineClient, tokenizer, options: ServerOptions,
              on_engine_death: Callable[[str], None] | None = None) -> FastAPI:
    metrics = ServerMetrics(options.served_model_name)
    prepare = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="muse-prepare")
    media_pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="muse-media")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.on_death = on_engine_death
        await client.start()
        if options.max_request_body_bytes is None:
            options.max_request_body_bytes = default_body_limit(client.ready.max_model_len,
                                                                options.max_token_bytes)
        options.lora_adapters = dict(client.ready.lora_adapters)
        stats_task = asyncio.create_task(log_stats_while_running(client, metrics, options))
        yield
        stats_task.cancel()
        await client.shutdown()
        prepare.shutdown(wait=False, cancel_futures=True)
        media_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="muse", version=muse.__version__, lifespan=lifespan)
    app.state.client, app.state.metrics = client, metrics

    async def off_loop(function: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            prepare, partial(function, *args))

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        return error_response(APIError(503, f"the engine failed: {error}", code="engine_dead"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError):
        return validation_error_response(error.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"
                   }.get(error.status_code, str(error.detail))
        return error_response(APIError(error.status_code, message,
                                       headers=getattr(error, "headers", None)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error ({type(error).__name__})",
                                       code="internal_error"))

    def require_engine() -> None:
        if not client.healthy:
            raise EngineDeadError(client.dead_reason or "not started")

    def admit(num_samples: int) -> None:
        """Check the engine is up and reserve room for the samples in the waiting queue."""
        if not client.healthy:
            raise APIError(503, f"the engine is not running: {client.dead_reason}",
                           code="engine_dead", headers={"Retry-After": "5"})
        if not client.reserve(num_samples, options.max_queued_requests):
            raise APIError(429, f"the server is overloaded: more than "
                                f"{options.max_queued_requests} samples would wait "
                                "(--max-queued-requests); retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await off_loop(parse_body, await request.body(), ChatCompletionRequest)
        admit(body.n)
        try:
            plan = await off_loop(plan_chat, body, tokenizer, client.ready, options)
            plan.media = await decode_media(plan.media_parts, options.media_limits, media_pool)
            request_id = client.new_request_id("chatcmpl")
            state = GenerationState()
            request.state.generations = [state]
            work = chat_completion(body, plan, client, tokenizer, options, metrics,
                                   request_id, state)
            return await work if body.stream else await cancel_on_disconnect(request, work)
        finally:
            client.release(body.n)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await off_loop(parse_body, await request.body(), CompletionRequest)
        prompts = completion_prompts(body, tokenizer)
        admit(len(prompts) * body.n)
        try:
            token_prompts = await off_loop(tokenize_prompts, prompts, tokenizer,
                                           client.ready, options)
            params = [plan_completion(body, prompt, client.ready, options)
                      for prompt in token_prompts]
            request_id = client.new_request_id("cmpl")
            states = [GenerationState() for _ in token_prompts]
            request.state.generations = states
            work = completion(body, token_prompts, params, client, tokenizer, options,
                              metrics, request_id, states)
            return await work if body.stream else await cancel_on_disconnect(request, work)
        finally:
            client.release(len(prompts) * body.n)

    @app.post("/generate")
    async def generate_tokens(request: Request):
        body = await off_loop(parse_body, await request.body(), GenerateRequest)
        prompt, params, lora_name = await off_loop(plan_generate, body, tokenizer, client.ready,
                                                   options)
        admit(params.n)
        try:
            request_id = body.rid or client.new_request_id("generate")
            state = GenerationState()
            request.state.generations = [state]

            async def work():
                updates: dict[int, list] = {i: [] for i in range(params.n)}
                try:
                    async for update in generate(client, tokenizer, request_id, prompt, params,
                                                 metrics, state, lora_name=lora_name):
                        updates[update.index].append(update)
                except RequestError as error:
                    raise APIError(error.status, str(error), param=error.param) from None
                results = generate_reply(request_id, updates, state, body.return_logprob)
                return results[0] if params.n == 1 else results

            return await cancel_on_disconnect(request, work())
        finally:
            client.release(params.n)

    @app.get("/v1/models")
    async def models():
        require_engine()
        base = {"id": options.served_model_name, "object": "model", "created": 0,
                "owned_by": "muse", "root": client.ready.model, "parent": None,
                "max_model_len": client.ready.max_model_len}
        adapters = [{**base, "id": name, "root": path, "parent": options.served_model_name}
                    for name, path in options.lora_adapters.items()]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        require_engine()
        body = await off_loop(parse_body, await request.body(), LoadLoRAAdapterRequest)
        await change_lora(LoadLoRA(client.new_request_id("lora"), body.lora_name,
                                   body.lora_path, body.load_inplace))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        require_engine()
        body = await off_loop(parse_body, await request.body(), UnloadLoRAAdapterRequest)
        await change_lora(UnloadLoRA(client.new_request_id("lora"), body.lora_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")

    async def change_lora(command: LoadLoRA | UnloadLoRA) -> None:
        try:
            options.lora_adapters = await client.change_lora(command)
        except RequestError as error:
            raise APIError(error.status, str(error), param=error.param) from None

    def tokenize_body(raw: bytes) -> tuple[list[int], list[MediaPart]]:
        """The prompt's ids, and a chat's media parts (their placeholders not expanded)."""
        body = parse_body(raw, TokenizeRequest)
        check_model(body.model, options)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            media_parts = check_media(body.messages, client.ready,
                                      options.limit_mm_per_prompt,
                                      video_fps_for(body.mm_processor_kwargs, client.ready,
                                                    options))
            tools = [t.model_dump() for t in body.tools] if body.tools else None
            return render_chat(body.messages, tools, body.add_generation_prompt,
                               body.chat_template_kwargs, tokenizer, client.ready,
                               options), media_parts
        return tokenize_prompts([body.prompt], tokenizer, client.ready, options,
                                body.add_special_tokens)[0], []

    @app.post("/tokenize")
    async def tokenize(request: Request):
        require_engine()
        tokens, media_parts = await off_loop(tokenize_body, await request.body())
        if media_parts:
            # As the chat route runs it: each item's placeholder becomes its tokens.
            media = await decode_media(media_parts, options.media_limits, media_pool)
            try:
                tokens = await client.expand_prompt(tokens, media)
            except RequestError as error:
                raise APIError(error.status, str(error), param=error.param) from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len":
                client.ready.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        require_engine()
        body = await off_loop(parse_body, await request.body(), DetokenizeRequest)
        check_model(body.model, options)
        bad = [t for t in body.tokens if not 0 <= t < client.ready.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of range: {bad[:5]}", param="tokens")
        return {"prompt": await off_loop(tokenizer.decode, body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        require_engine()
        client.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        if client.healthy:
            return Response(status_code=200)
        return JSONResponse({"status": "engine dead", "reason": client.dead_reason},
                            status_code=503)

    @app.get("/version")
    async def version():
        return {"version": muse.__version__}

    @app.get("/metrics")
    async def prometheus():
        metrics.update_engine(client.stats)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    # The last added runs first: count, then CORS, then the key, then the body.
    app.add_middleware(BufferedBody, limits=options)
    app.add_middleware(RequireAPIKey, api_key=options.api_key)
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(CountRequests, counter=metrics.requests,
                       skip_paths=frozenset({"/health", "/metrics"}))
    return app

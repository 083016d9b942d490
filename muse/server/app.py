"""The FastAPI application: routes, authentication, errors, health and metrics."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

import muse
from muse.server.chat import chat_completion
from muse.server.completions import completion
from muse.server.engine_client import EngineClient, EngineDeadError
from muse.server.errors import APIError, error_response, validation_error_response
from muse.server.metrics import ServerMetrics
from muse.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from muse.server.serving import (
    ServerOptions,
    check_model,
    completion_prompts,
    plan_chat,
    plan_completion,
)


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


def build_app(client: EngineClient, tokenizer, options: ServerOptions) -> FastAPI:
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.start()
        yield
        await client.shutdown()

    app = FastAPI(title="muse", version=muse.__version__, lifespan=lifespan)
    app.state.client, app.state.metrics = client, metrics

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        metrics.requests.labels(status=f"http_{error.status}").inc()
        return error_response(error)

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        metrics.requests.labels(status="http_500").inc()
        return error_response(APIError(500, f"the engine failed: {error}", code="engine_dead"))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError):
        metrics.requests.labels(status="http_400").inc()
        return validation_error_response(error.errors())

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if options.api_key and request.url.path.startswith("/v1"):
            if request.headers.get("authorization") != f"Bearer {options.api_key}":
                return error_response(APIError(401, "invalid or missing API key",
                                               code="invalid_api_key"))
        return await call_next(request)

    async def body_of(request: Request, model):
        """Parse the JSON body ourselves so bad JSON and bad fields are both a 400."""
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json")
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(data)
        except ValidationError as error:
            raise _validation_api_error(error) from None

    def admit() -> None:
        if not client.healthy:
            raise APIError(500, f"the engine is not running: {client.dead_reason}",
                           code="engine_dead")
        queued = len(client.queues) - client.stats.running
        if queued >= options.max_queued_requests:
            raise APIError(503, "the server is overloaded; retry later", code="overloaded",
                           headers={"Retry-After": "1"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request, ChatCompletionRequest)
        admit()
        plan = plan_chat(body, tokenizer, client.ready, options)
        request_id = client.new_request_id("chatcmpl")
        work = chat_completion(body, plan, client, tokenizer, options, metrics, request_id)
        return await work if body.stream else await cancel_on_disconnect(request, work)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await body_of(request, CompletionRequest)
        admit()
        prompts = completion_prompts(body, tokenizer)
        params = [plan_completion(body, prompt, client.ready, options) for prompt in prompts]
        request_id = client.new_request_id("cmpl")
        work = completion(body, prompts, params, client, tokenizer, options, metrics,
                          request_id)
        return await work if body.stream else await cancel_on_disconnect(request, work)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": options.served_model_name, "object": "model", "created": 0,
            "owned_by": "muse", "max_model_len": client.ready.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request, TokenizeRequest)
        check_model(body.model, options)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        if body.messages is not None:
            tokens = tokenizer.apply_chat_template(
                [m.model_dump(exclude_none=True) for m in body.messages], tokenize=True,
                add_generation_prompt=body.add_generation_prompt)
        else:
            tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len":
                client.ready.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await body_of(request, DetokenizeRequest)
        check_model(body.model, options)
        bad = [t for t in body.tokens if not 0 <= t < client.ready.vocab_size]
        if bad:
            raise APIError(400, f"token ids out of range: {bad[:5]}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

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

    return app


def _validation_api_error(error: ValidationError) -> APIError:
    response = validation_error_response(error.errors())
    detail = json.loads(response.body)["error"]
    return APIError(400, detail["message"], param=detail["param"], code="invalid_value")

"""A request's output constraint, from whichever field gives it: OpenAI's `response_format`,
vLLM's `structured_outputs` or its earlier `guided_*` fields (one of them at most), as the
engine's `StructuredOutput`; any problem is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from muse.engine.errors import InvalidRequestError
from muse.engine.structured_output import StructuredOutput
from muse.server.errors import APIError
from muse.server.messages import EngineReady
from muse.server.protocol import ResponseFormat, SamplingFields, StructuredOutputsParams


def structured_output_for(request: SamplingFields, ready: EngineReady
                          ) -> StructuredOutput | None:
    """The request's constraint: `response_format`, or vLLM's `structured_outputs`, or one
    of its earlier `guided_*` fields (at most one of them)."""
    given = {name: value for name, value in (
        ("response_format", _response_format(request)),
        ("structured_outputs", request.structured_outputs),
        *((f"guided_{kind}", getattr(request, f"guided_{kind}"))
          for kind in ("json", "regex", "choice", "grammar"))) if value is not None}
    if len(given) > 1:
        raise APIError(400, f"give one way to constrain the output, not {sorted(given)}",
                       param=sorted(given)[1])
    if not given:
        return None
    [(name, value)] = given.items()
    with invalid_request_as_400():
        if name == "response_format":
            return _from_response_format(value, ready)
        if name == "structured_outputs":
            return _from_structured_outputs(value, ready)
        kind = name.removeprefix("guided_")
        return _constraint(kind, value, name, ready)


def _response_format(request: SamplingFields) -> ResponseFormat | None:
    form = getattr(request, "response_format", None)
    return None if form is None or form.type == "text" else form


def _from_response_format(response_format: ResponseFormat, ready: EngineReady
                          ) -> StructuredOutput:
    if response_format.type == "json_object":
        return StructuredOutput("json")
    if response_format.json_schema is None or not response_format.json_schema.schema_:
        raise APIError(400, "`response_format.json_schema.schema` is required for type "
                            "json_schema", param="response_format.json_schema")
    return StructuredOutput.for_schema(response_format.json_schema.schema_,
                                       max_bytes=ready.max_grammar_bytes)


def _from_structured_outputs(params: StructuredOutputsParams, ready: EngineReady
                             ) -> StructuredOutput:
    if params.structural_tag is not None:
        raise APIError(400, "`structured_outputs.structural_tag` is not supported",
                       param="structured_outputs.structural_tag")
    given = {kind: value for kind, value in (
        ("json", params.json_), ("regex", params.regex), ("choice", params.choice),
        ("grammar", params.grammar), ("json_object", params.json_object or None))
        if value is not None}
    if len(given) != 1:
        raise APIError(400, "`structured_outputs` takes exactly one of json, regex, choice, "
                            f"grammar and json_object; got {sorted(given) or 'none'}",
                       param="structured_outputs")
    [(kind, value)] = given.items()
    return _constraint(kind, value, f"structured_outputs.{kind}", ready)


def _constraint(kind: str, value: Any, param: str, ready: EngineReady) -> StructuredOutput:
    """A schema (an object or its JSON text), a regex, choices or a grammar, from `param`."""
    limit = ready.max_grammar_bytes
    if kind == "json_object":
        return StructuredOutput("json", param=param)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, f"`{param}` is not valid JSON", param=param) from None
        if not isinstance(value, dict):
            raise APIError(400, f"`{param}` must be a JSON schema object", param=param)
        return StructuredOutput.for_schema(value, limit, param=param)
    if kind == "choice":
        return StructuredOutput.for_choice(value, limit, param=param)
    return StructuredOutput.for_text(kind, value, limit, param=param)


@contextmanager
def invalid_request_as_400() -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None

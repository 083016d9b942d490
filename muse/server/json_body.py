"""Request bodies: JSON text -> a validated pydantic model, every problem a 400 naming the field.

Runs off the event loop (see app.py): parsing a body of several megabytes takes a while.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from muse.server.errors import APIError, validation_error_response

Model = TypeVar("Model", bound=BaseModel)


def parse_body(raw: bytes, model: type[Model]) -> Model:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    where = lone_surrogate_path(data)
    if where is not None:
        # JSON may spell half of a UTF-16 pair (`"\ud800"`), which no UTF-8 text can hold:
        # the tokenizer, the logs and the reply would all fail on it later.
        raise APIError(400, f"{where} holds a lone UTF-16 surrogate (invalid Unicode)",
                       param=where, code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        detail = json.loads(validation_error_response(error.errors()).body)["error"]
        raise APIError(400, detail["message"], param=detail["param"],
                       code="invalid_value") from None


def lone_surrogate_path(data: Any) -> str | None:
    """Path (`messages[0].content`) of the first key or string with a lone surrogate."""
    for path, text in json_strings(data, keys=True):
        if not _is_valid_unicode(text):
            return path or "body"
    return None


def json_strings(data: Any, keys: bool = False) -> Iterator[tuple[str, str]]:
    """(path, text) of every string in a JSON value (and of every key, with `keys`; a key's
    path is its object's). Iterative: a body may nest as deep as the JSON parser allowed."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            yield path, value
        elif isinstance(value, dict):
            for key, item in value.items():
                if keys:
                    yield path, key
                stack.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _is_valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or HTTPStatus(status).phrase.lower().replace(" ", "_")
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": code or str(status)}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, error.param, error.code),
                        status_code=error.status, headers=error.headers)


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """A pydantic validation failure as a 400 naming the first bad field."""
    first = errors[0] if errors else {}
    param = _field_path(first.get("loc", ()))
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)


def _field_path(location: tuple) -> str | None:
    """pydantic's error location as `messages[0].content`, without its union-member tags."""
    path = ""
    for part in location:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict"):
            continue  # e.g. "literal['none','auto']" or "list[int]": which union member failed
        else:
            path += f".{part}" if path else part
    return path or None

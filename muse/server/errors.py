"""OpenAI-shaped error responses: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from http import HTTPStatus

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
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
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return JSONResponse(error_body(400, message, param, "invalid_value"), status_code=400)

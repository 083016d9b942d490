"""Errors a client can cause; the server maps them to OpenAI-style 400 responses."""


class InvalidRequestError(ValueError):
    """A request cannot be served; the message names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status  # 404 for something named that does not exist

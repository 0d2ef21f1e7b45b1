"""The one error a request can end in, and its body in OpenAI's shape: `{"error": {"message", "type", "param",
"code"}}`. Every refusal the server makes (400, 401, 404, 413, 503, 500) is one of these, never a traceback."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi.responses import JSONResponse

# OpenAI's error types by status; the clients map the status to an exception class and show the message.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 503: "server_overloaded",
               500: "server_error"}


@dataclass
class APIError(Exception):
    status: int
    message: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        super().__init__(self.message)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

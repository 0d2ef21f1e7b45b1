"""What every request passes before it is routed: the API key (where the server has one) and the body's size.

Plain ASGI middleware, so that a refusal costs no parsing: a body larger than the limit is refused from its
Content-Length before it is read, or as soon as its chunks add up past the limit.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve.errors import APIError

OPEN_PATHS = ("/health",)  # what a load balancer probes: answered without the key, as llama-server and vLLM do


class RequireKey:
    """Every request but OPEN_PATHS carries `Authorization: Bearer <key>`, or gets a 401."""

    def __init__(self, app: ASGIApp, key: str):
        self.app = app
        self.expected = f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                refusal = APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                                        "with the server's --api-key", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitBody:
    """A request body of at most `max_bytes`; a larger one gets a 413."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def _refusal(self) -> APIError:
        return APIError(413, f"the request body is larger than the server takes ({self.max_bytes} bytes)",
                        code="request_too_large")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._refusal().response()(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._refusal()  # the app's APIError handler answers it
            return message

        await self.app(scope, limited, send)

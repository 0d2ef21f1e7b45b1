"""The routes: OpenAI's chat and text completions, the model list and a health probe, over one engine.

A request is parsed and checked (`serve.schema`), queued (`serve.worker`), and answered once its generation has
started: its first event decides the status, so a prompt the engine refuses (longer than the context, a setting out
of bounds) is a 400 even when a stream was asked for. A client that goes away while its request waits or runs
cancels it. The bodies are built in `serve.replies`, the stream's events in `serve.sse`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve import sse
from serve.errors import APIError, error_body
from serve.guard import LimitBody, RequireKey
from serve.replies import ChatShape, CompletionShape, Shape
from serve.schema import ChatRequest, CompletionRequest, GenerationRequest, parse
from serve.worker import Cancelled, Engine, Event, Failed, Finished, Job, Piece, QueueFull, Worker

log = logging.getLogger("specchat.serve")
CLIENT_CLOSED = 499  # the status a request whose client went away is logged with (nginx's); nobody reads it


@dataclass(frozen=True)
class ServeConfig:
    model_name: str = "specchat"
    strategy: str | None = None  # when a request names none; None: the engine's first
    defaults: Mapping[str, Any] = field(default_factory=dict)  # engine settings a request starts from (the flags')
    system: str | None = None  # the system prompt of a chat whose messages bring none
    queue_size: int = 16  # requests waiting behind the one generating; more get a 503
    max_body_bytes: int = 4 << 20
    api_key: str | None = None
    retry_after_seconds: int = 1  # what a 503 asks the client to wait

    def __post_init__(self):
        if self.queue_size < 1:
            raise ValueError(f"the queue must hold at least one request, got {self.queue_size}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key is empty")


@dataclass
class Server:
    engine: Engine
    worker: Worker
    config: ServeConfig
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def default_strategy(self) -> str:
        return self.config.strategy or list(self.engine.strategies)[0]

    @property
    def context_length(self) -> int | None:
        """What bounds max_tokens: the engine's context (the shortest of its models')."""
        return getattr(self.engine, "context_length", None)


router = APIRouter()


def create_app(engine: Engine, config: ServeConfig = ServeConfig()) -> FastAPI:
    """The ASGI app serving `engine`; its generation thread runs while the app's lifespan does."""
    worker = Worker(engine, config.queue_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="specchat", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = Server(engine, worker, config)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(LimitBody, max_bytes=config.max_body_bytes)
    if config.api_key is not None:
        app.add_middleware(RequireKey, key=config.api_key)  # added last: outermost, before the body is read
    app.include_router(router)
    return app


def _server(request: Request) -> Server:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    worker = _server(request).worker
    return {"status": "ok", "generating": worker.busy, "waiting": worker.waiting}


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    server = _server(request)
    model = {"id": server.config.model_name, "object": "model", "created": server.started, "owned_by": "specchat",
             "specchat": {"strategies": list(server.engine.strategies), "strategy": server.default_strategy}}
    return {"object": "list", "data": [model]}


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = parse(ChatRequest, await request.body())
    messages = [message.as_engine_message() for message in body.messages]
    system = _server(request).config.system
    if system and not any(message["role"] == "system" for message in messages):
        messages.insert(0, {"role": "system", "content": system})
    return await respond(request, body, messages, ChatShape(_server(request).config.model_name), {})


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    body = parse(CompletionRequest, await request.body())
    return await respond(request, body, body.text, CompletionShape(_server(request).config.model_name),
                         {"chat": False})


async def respond(request: Request, body: GenerationRequest, prompt: str | list[dict[str, str]], shape: Shape,
                  extra: dict[str, Any]) -> Response:
    server = _server(request)
    strategy, settings = plan(server, body)
    job = Job(prompt, strategy, {**settings, **extra}, loop=asyncio.get_running_loop())
    try:
        server.worker.submit(job)
    except QueueFull:
        raise APIError(503, f"the server is busy: {server.worker.capacity} requests are waiting already; retry "
                            "later", code="queue_full",
                       headers={"Retry-After": str(server.config.retry_after_seconds)}) from None
    async with watching(request, job):  # a client gone while it waits or (no stream) while it runs cancels it
        first = await job.events.get()
        if isinstance(first, Failed):
            raise failure(first.error)
        if not body.stream:
            event: Event = first
            while isinstance(event, Piece):
                event = await job.events.get()
            if isinstance(event, Failed):
                raise failure(event.error)
            if isinstance(event, Cancelled):
                return Response(status_code=CLIENT_CLOSED)
            assert isinstance(event, Finished)
            return JSONResponse(shape.whole(event.reply))
    if isinstance(first, Cancelled):
        return Response(status_code=CLIENT_CLOSED)
    return StreamingResponse(stream(job, first, shape, body.include_usage), media_type=sse.MEDIA_TYPE,
                             headers=sse.HEADERS)


def plan(server: Server, body: GenerationRequest) -> tuple[str, dict[str, Any]]:
    """The strategy and the engine settings `body` asks for, over the server's defaults; a 400 for a strategy the
    server does not run or more new tokens than the context holds."""
    strategy = body.strategy or server.default_strategy
    served = list(server.engine.strategies)
    if strategy not in served:
        raise APIError(400, f"strategy {strategy!r} is not served here; choose from {', '.join(served)}",
                       param="specchat.strategy")
    settings = {**server.config.defaults, **body.settings()}
    context = server.context_length
    new_tokens = settings.get("max_new_tokens")
    if context is not None and isinstance(new_tokens, int) and new_tokens >= context:
        raise APIError(400, f"max_tokens is {new_tokens}; the model's context holds {context} tokens, the prompt's "
                            "included: ask for fewer", param="max_tokens")
    return strategy, settings


@contextlib.asynccontextmanager
async def watching(request: Request, job: Job) -> AsyncIterator[None]:
    """Cancel `job` if the client disconnects while the block runs (its body is read: the next message is that)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def stream(job: Job, first: Event, shape: Shape, include_usage: bool) -> AsyncIterator[bytes]:
    """The job's events as server-sent events, ending in [DONE]. The response cancels this generator when the
    client disconnects; the job is then cancelled with it."""
    try:
        opening = shape.opening()
        if opening is not None:
            yield sse.event(opening)
        event = first
        while isinstance(event, Piece):
            yield sse.event(shape.piece(event.text))
            event = await job.events.get()
        if isinstance(event, Finished):
            yield sse.event(shape.closing(event.reply))
            if include_usage:
                yield sse.event(shape.usage_chunk(event.reply))
        elif isinstance(event, Failed):
            yield sse.event(failure(event.error).body())
        yield sse.DONE
    finally:
        job.cancel()  # nothing, where it finished


def failure(error: Exception) -> APIError:
    """A generation's failure as the request's answer: the engine's ValueError is the request's fault (a prompt past
    the context, a setting out of bounds), anything else the server's, logged here with its traceback."""
    if isinstance(error, APIError):
        return error
    reason = next(iter(str(error).strip().splitlines()), "")
    if isinstance(error, ValueError):
        return APIError(400, reason or type(error).__name__, param=getattr(error, "setting", None))
    log.error("a generation failed", exc_info=error)
    return APIError(500, f"the generation failed ({type(error).__name__}: {reason})" if reason else
                    f"the generation failed ({type(error).__name__})")


async def _api_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, APIError)
    return error.response()


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, StarletteHTTPException)
    return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code,
                        headers=error.headers)


async def _internal_error(request: Request, error: Exception) -> Response:
    log.error("a request failed", exc_info=error)
    return JSONResponse(error_body(500, f"the server failed ({type(error).__name__})"), status_code=500)

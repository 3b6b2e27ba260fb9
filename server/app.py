"""The FastAPI app factory: routes, OpenAI-shaped errors, metrics, and the engine's lifecycle.

    app = create_app(AsyncEngine.from_config(EngineConfig(...)))
    uvicorn.run(app)

The app's lifespan starts the engine's step loop and stops it at shutdown. Every error leaves as
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: pydantic validation errors
(malformed JSON, unknown or bad fields) become 400 with ``param`` naming the field, a body over
``max_request_body_bytes`` a 413. `begin_shutdown` starts a graceful shutdown (server/launcher.py
calls it on SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.errors import EngineError, ShuttingDownError
from specserve.server.metrics import ServerMetrics
from specserve.server.openai_routes import OpenAIError, ServerState, clip, engine_error, get_state, router
from specserve.server.token_routes import keyed as keyed_token_router
from specserve.server.token_routes import router as token_router
from specserve.server.openapi import install_openapi
from specserve.server.prompt_guard import default_body_limit

logger = logging.getLogger("specserve.server")

API_KEY_ENV = "SPECSERVE_API_KEY"
FALLBACK_MAX_REQUEST_BODY_BYTES = 8 * 2**20   # the "auto" limit when the tokenizer gives no prompt bound
DRAIN_LIMIT_FACTOR = 8   # an oversized body is read (and dropped) up to this many limits, so the client gets its 413
# endpoints whose rejections count in specserve_requests_total{status="rejected"|"error"}
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def create_app(engine, *, served_model_name: str | None = None, api_key: str | None = None,
               max_request_body_bytes: int | str | None = "auto", tool_call_parser: str = "auto",
               vllm_metrics: bool = True, cors: dict | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (an `AsyncEngine`, not yet started).

    `served_model_name` defaults to the engine's model name (``"default"`` is always accepted too);
    `api_key` (or ``$SPECSERVE_API_KEY``) turns on the Bearer check for ``/v1/*``; a request body over
    `max_request_body_bytes` (None: no limit; "auto": derived from the context length, see
    `prompt_guard.default_body_limit`) is answered 413 before it is parsed. `tool_call_parser` reads
    the model's own tool calls for `tool_choice: "auto"` (server/tool_parsers.py; "auto" picks it from
    the chat template). `vllm_metrics`: /metrics also exports vLLM's series under vLLM's names.
    `cors`: Starlette's `CORSMiddleware` keywords (allow_origins, ...), None for no CORS headers.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            app.state.specserve.draining = True
            await asyncio.to_thread(engine.shutdown)
            app.state.specserve.lanes.shutdown()

    app = FastAPI(title="specserve", summary="OpenAI-compatible inference with speculative decoding",
                  lifespan=lifespan)
    model_name = served_model_name or engine.model_name
    app.state.specserve = ServerState(engine=engine, model_name=model_name,
                                      metrics=ServerMetrics(engine, model_name, vllm_metrics),
                                      api_key=api_key or os.environ.get(API_KEY_ENV) or None,
                                      tool_call_parser=tool_call_parser)
    app.include_router(router)
    app.include_router(token_router)
    app.include_router(keyed_token_router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(raw: Request) -> Response:
        return Response(get_state(raw).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    _install_error_handlers(app)
    install_openapi(app)
    if max_request_body_bytes == "auto":
        bound = app.state.specserve.bound
        max_request_body_bytes = (default_body_limit(engine.max_model_len, bound) if bound is not None
                                  else FALLBACK_MAX_REQUEST_BODY_BYTES)
    if max_request_body_bytes is not None:
        app.add_middleware(BodySizeLimit, max_bytes=int(max_request_body_bytes))
    if cors:      # outermost: a preflight is answered before anything reads a body
        app.add_middleware(CORSMiddleware, **cors)
    return app


def begin_shutdown(app: FastAPI, timeout: float | None) -> None:
    """Start a graceful shutdown: /health fails and new requests get 503 at once; requests in flight
    run on, and those still running `timeout` seconds later (None: no limit) end with a 503 error
    (an error event on a stream) instead of being cut off. Idempotent; callable from any thread."""
    state = app.state.specserve
    if state.draining:
        return
    state.draining = True
    logger.info("shutting down: no new requests; in-flight ones have %s to finish",
                "no time limit" if timeout is None else f"{timeout:g} s")
    if timeout is None:
        return
    error = ShuttingDownError(f"The server is shutting down and ended this request after the {timeout:g} s "
                              "shutdown timeout; retry it on another replica.")
    timer = threading.Timer(timeout, state.engine.fail_all, args=(error,))
    timer.daemon = True
    timer.start()


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"The request body is larger than this server's limit of {limit} bytes.")


class BodySizeLimit:
    """ASGI middleware: a request body over `max_bytes` -- by its Content-Length or as it streams in --
    fails the endpoint's body read with a 413 (answered by the app's error handlers).

    What the client already sent is read and dropped (up to DRAIN_LIMIT_FACTOR limits) before the
    answer, so a client still writing its body reads the 413 instead of a reset connection."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_bytes
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        received = 0

        async def limited_receive():
            nonlocal received
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await self._drain(receive, 0, int(declared))
                raise _BodyTooLarge(limit)
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    if message.get("more_body", False):
                        await self._drain(receive, received, None)
                    raise _BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive, received: int, declared: int | None) -> None:
        cap = DRAIN_LIMIT_FACTOR * self.max_bytes
        if declared is not None and declared > cap:
            return   # not worth reading: the connection is closed after the answer
        while received <= cap:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


# ---- errors -----------------------------------------------------------------------------------


def _count_rejection(request: Request, status_code: int) -> None:
    """Count a request answered with an error before its engine call tracked it."""
    if request.url.path in COMPLETION_PATHS and not getattr(request.state, "specserve_tracked", False):
        get_state(request).metrics.count("rejected" if status_code < 500 else "error")


def _error_response(request: Request, exc: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    _count_rejection(request, exc.status_code)
    headers = dict(headers or {})
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return exc.response(headers or None)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """("body", "stop", "list[str]", 1) -> "stop.1" (union-member tags dropped)."""
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and item.isidentifier() and item not in _UNION_TAGS:
            parts.append(item)
        # else: a union member's tag ("list[str]", "str", ...): skip it, the path goes on after it
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """Pydantic's error list as one OpenAI-style 400 naming the first bad parameter."""
    if not errors:
        return OpenAIError(400, "invalid request", code="invalid_request")
    err = errors[0]
    kind, loc, msg = err.get("type", ""), tuple(err.get("loc", ())), str(err.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    param = (err.get("ctx") or {}).get("param") or _param_of(loc)
    if kind == "json_invalid":
        return OpenAIError(400, "We could not parse the JSON body of your request: "
                           f"{(err.get('ctx') or {}).get('error', msg)}. The body must be a JSON object.",
                           code="invalid_json")
    if kind == "missing" and param is None:
        return OpenAIError(400, "The request body is missing or is not a JSON object.", code="invalid_json")
    if kind == "model_attributes_type" and param is None:
        return OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    if kind == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {clip(param)}"
        code = "unknown_parameter"
    elif kind == "missing":
        message, code = f"Missing required parameter: '{clip(param)}'.", "missing_required_parameter"
    elif kind == "invalid_param":
        message, code = msg, "invalid_value"
    else:
        message, code = f"Invalid value for '{clip(param)}': {msg}", "invalid_value"
        value = err.get("input")
        if isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 64):
            message += f" (got {json.dumps(value)})"
    if len(errors) > 1:
        message += f" ({len(errors) - 1} more validation error{'s' if len(errors) > 2 else ''})"
    return OpenAIError(400, message, param=param, code=code)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(request, exc)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _error_response(request, engine_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = None   # OpenAIError's default for the status: request_too_large, request_timeout, not_found, ...
        if exc.status_code == 404:
            message = f"Unknown route: {clip(request.method)} {clip(request.url.path)}"
        elif exc.status_code == 400 and message == "There was an error parsing the body":
            # FastAPI's answer to a body json.loads could not take (nesting too deep, an int too long)
            message = ("We could not parse the JSON body of your request: it nests too deeply or holds a number "
                       "too long to read. The body must be a JSON object.")
            code = "invalid_json"
        elif exc.status_code == 405:
            message = f"Method {clip(request.method)} is not allowed on {clip(request.url.path)}"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        # e.g. a 405's Allow header, which Starlette sets
        return _error_response(request, OpenAIError(exc.status_code, message, type=kind, code=code), exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so the server logs the traceback
        return _error_response(request, OpenAIError(500, f"internal server error: {type(exc).__name__}",
                                                    type="server_error", code="internal_error"))

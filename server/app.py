"""The FastAPI app factory: routes, OpenAI-shaped errors, metrics, and the engine's lifecycle.

    app = create_app(AsyncEngine.from_config(EngineConfig(...)))
    uvicorn.run(app)

The app's lifespan starts the engine's step loop and stops it at shutdown. Every error leaves as
OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: pydantic validation errors
(malformed JSON, unknown or bad fields) become 400 with ``param`` naming the field.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from specserve.engine.errors import EngineError
from specserve.server.metrics import ServerMetrics
from specserve.server.openai_routes import OpenAIError, ServerState, engine_error, get_state, router

API_KEY_ENV = "SPECSERVE_API_KEY"
# endpoints whose rejections count in specserve_requests_total{status="rejected"|"error"}
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def create_app(engine, *, served_model_name: str | None = None, api_key: str | None = None) -> FastAPI:
    """An OpenAI-compatible app serving `engine` (an `AsyncEngine`, not yet started).

    `served_model_name` defaults to the engine's model name (``"default"`` is always accepted too);
    `api_key` (or ``$SPECSERVE_API_KEY``) turns on the Bearer check for ``/v1/*``.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="specserve", summary="OpenAI-compatible inference with speculative decoding",
                  lifespan=lifespan)
    model_name = served_model_name or engine.model_name
    app.state.specserve = ServerState(engine=engine, model_name=model_name,
                                      metrics=ServerMetrics(engine, model_name),
                                      api_key=api_key or os.environ.get(API_KEY_ENV) or None)
    app.include_router(router)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(raw: Request) -> Response:
        return Response(get_state(raw).metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    _install_error_handlers(app)
    return app


# ---- errors -----------------------------------------------------------------------------------


def _count_rejection(request: Request, status_code: int) -> None:
    """Count a request answered with an error before its engine call tracked it."""
    if request.url.path in COMPLETION_PATHS and not getattr(request.state, "specserve_tracked", False):
        get_state(request).metrics.count("rejected" if status_code < 500 else "error")


def _error_response(request: Request, exc: OpenAIError) -> JSONResponse:
    _count_rejection(request, exc.status_code)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
    return exc.response(headers)


def _param_of(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content", "str") -> "messages.0.content" (union-member tags dropped)."""
    parts = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and item.isidentifier() and item not in _UNION_TAGS:
            parts.append(item)
        else:
            break
    return ".".join(parts) or None


def validation_error(errors: list[dict[str, Any]]) -> OpenAIError:
    """Pydantic's error list as one OpenAI-style 400 naming the first bad parameter."""
    if not errors:
        return OpenAIError(400, "invalid request")
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
        message = f"Unrecognized request argument supplied: {param}"
        code = "unknown_parameter"
    elif kind == "missing":
        message, code = f"Missing required parameter: '{param}'.", "missing_required_parameter"
    elif kind == "invalid_param":
        message, code = msg, "invalid_value"
    else:
        message, code = f"Invalid value for '{param}': {msg}", "invalid_value"
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
        if exc.status_code == 404:
            message = f"Unknown route: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}"
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(request, OpenAIError(exc.status_code, message, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so the server logs the traceback
        return _error_response(request, OpenAIError(500, f"internal server error: {type(exc).__name__}",
                                                    type="server_error"))

"""The OpenAPI document served at /openapi.json: FastAPI's, patched to say what the server answers.

FastAPI derives the request bodies from the routes, but the routes return `Response` objects (so it
knows no response bodies) and it documents a 422 the server never sends (validation errors are
400s); and it writes every bound as a float, so an int64 bound such as the seed's 2**63 - 1 comes
out as 2**63. `install_openapi` builds the document once, puts pydantic's own schemas of the
request and response models (chunks included) in ``components/schemas``, and for each operation in
`OPERATIONS` replaces the responses with:

* the 200: its JSON body, and for the completion routes the ``stream: true`` answer as
  ``text/event-stream`` (the schema of one event, as OpenAPI 3.2's ``itemSchema`` and schemathesis
  read it: ``data`` is a chunk as JSON, an error body, or ``[DONE]``);
* every error status the server answers, each with OpenAI's error body (`ErrorResponse`), shared
  through ``components/responses``.

``model`` (and the ``model_id`` of ``GET /v1/models/{model_id}``) lists the served model's names:
any other is answered 404.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from specserve.server.protocol import (ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionChunk, CompletionRequest, CompletionResponse, DetokenizeRequest,
                                       DetokenizeResponse, ErrorResponse, HealthStatus, ModelCard, ModelList,
                                       TokenizeRequest, TokenizeResponse, VersionInfo)

SCHEMA_REF = "#/components/schemas/{model}"

# status -> (name in components/responses, description)
ERRORS: dict[int, tuple[str, str]] = {
    400: ("BadRequest", "Invalid request: malformed JSON, an unknown parameter, a value of the wrong type or out "
                        "of range, an unsupported feature, or a prompt plus max_tokens over the model's context. "
                        "`param` names the parameter."),
    401: ("Unauthorized", "The server has an API key and the request did not send it as "
                          "`Authorization: Bearer <key>`."),
    404: ("NotFound", "No such model: this server serves one model (`code: model_not_found`)."),
    408: ("RequestTimeout", "The request body did not arrive whole within the server's body timeout "
                            "(`code: request_timeout`); the connection is closed."),
    413: ("ContentTooLarge", "The request body is larger than the server's limit (`code: request_too_large`)."),
    429: ("TooManyRequests", "The engine's queue is full (`code: queue_full`): more requests wait beyond the free "
                             "sequence slots than the server queues; retry after the `Retry-After` header's seconds."),
    500: ("InternalServerError", "An internal error, or the engine failed on this request."),
    503: ("ServiceUnavailable", "The engine is not running (`code: engine_dead`) or the server is shutting down "
                                "(`code: shutting_down`); retry on another replica."),
}
COMPLETION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)
TOKENIZE_ERRORS = (400, 404, 408, 413, 429, 500)    # vLLM's utility routes: outside /v1, so no API key


class Operation(NamedTuple):
    request: type[BaseModel] | None        # the request body (FastAPI documents it; its schema is redone exactly)
    body: type[BaseModel]                  # the 200's JSON body
    chunk: type[BaseModel] | None          # the data of each streamed event, for a route that streams
    errors: tuple[int, ...]                # the error statuses it answers (keys of ERRORS)


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("post", "/v1/chat/completions"): Operation(ChatCompletionRequest, ChatCompletionResponse, ChatCompletionChunk,
                                                COMPLETION_ERRORS),
    ("post", "/v1/completions"): Operation(CompletionRequest, CompletionResponse, CompletionChunk, COMPLETION_ERRORS),
    ("get", "/v1/models"): Operation(None, ModelList, None, (401, 500)),
    ("get", "/v1/models/{model_id}"): Operation(None, ModelCard, None, (401, 404, 500)),
    ("get", "/health"): Operation(None, HealthStatus, None, (503,)),
    ("get", "/ping"): Operation(None, HealthStatus, None, (503,)),
    ("post", "/ping"): Operation(None, HealthStatus, None, (503,)),
    ("get", "/version"): Operation(None, VersionInfo, None, ()),
    ("post", "/tokenize"): Operation(TokenizeRequest, TokenizeResponse, None, TOKENIZE_ERRORS),
    ("post", "/detokenize"): Operation(DetokenizeRequest, DetokenizeResponse, None, TOKENIZE_ERRORS),
}


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` return this server's OpenAPI document (built on first use, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi


def build_openapi(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, openapi_version=app.openapi_version,
                      summary=app.summary, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):   # only FastAPI's 422 used them
        schemas.pop(name, None)
    models = [(op.request, "validation") for op in OPERATIONS.values() if op.request is not None]
    models += [(m, "serialization") for op in OPERATIONS.values() for m in (op.body, op.chunk) if m is not None]
    _, defs = models_json_schema([*models, (ErrorResponse, "serialization")], ref_template=SCHEMA_REF)
    schemas.update(defs["$defs"])
    _name_the_served_model(doc, sorted(app.state.specserve.model_aliases))
    components["responses"] = {name: _error_response(status, description)
                               for status, (name, description) in ERRORS.items()}
    components["responses"][ERRORS[429][0]]["headers"] = {"Retry-After": {
        "description": "Seconds to wait before retrying (an integer, at least 1).",
        "schema": {"type": "integer", "minimum": 1}}}

    for path_item in doc["paths"].values():
        for operation in path_item.values():
            operation.get("responses", {}).pop("422", None)
    for (method, path), op in OPERATIONS.items():
        responses = {"200": _ok_response(op)}
        responses.update({str(status): {"$ref": f"#/components/responses/{ERRORS[status][0]}"}
                          for status in op.errors})
        doc["paths"][path][method]["responses"] = responses
    return doc


def _name_the_served_model(doc: dict[str, Any], names: list[str]) -> None:
    """Document `names` as the only values of the requests' ``model`` and of ``GET /v1/models/{model_id}``."""
    served = {"type": "string", "enum": names}
    schemas = doc["components"]["schemas"]
    for op in OPERATIONS.values():
        if op.request is not None:
            schemas[op.request.__name__]["properties"]["model"] = {
                "anyOf": [served, {"type": "null"}], "default": None, "title": "Model",
                "description": "A name of the served model; omitted or null: the served model."}
    for param in doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
        if param["name"] == "model_id":
            param["schema"] = {**served, "title": "Model Id"}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": SCHEMA_REF.format(model=model.__name__)}


def _error_response(status: int, description: str) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description,
                                "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"description": "`Bearer`", "required": True,
                                                    "schema": {"type": "string"}}}
    return response


def _ok_response(op: Operation) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(op.body)}}
    if op.chunk is None:
        return {"description": "OK", "content": content}
    name = op.chunk.__name__
    content["text/event-stream"] = {"schema": {
        "description": (
            f"With `stream: true`: server-sent events, each a `data: <JSON>` line and a blank line. This schema "
            f"is one event's: its `data` is a `{name}` as JSON (with `stream_options.include_usage`, the last "
            f"one has no choices and carries `usage`), an `ErrorResponse` as JSON when the request fails after "
            f"the stream began, and `[DONE]`, which ends every stream."),
        "type": "object",
        "properties": {"data": {"anyOf": [
            {"type": "string", "contentMediaType": "application/json",
             "contentSchema": {"anyOf": [_ref(op.chunk), _ref(ErrorResponse)]}},
            {"const": "[DONE]"},
        ]}},
        "required": ["data"],
    }}
    return {"description": f"The completion: a `{op.body.__name__}`, or with `stream: true` a stream of "
                           f"`{name}` events.", "content": content}

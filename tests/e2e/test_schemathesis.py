"""The server against its own OpenAPI document: schemathesis generates request bodies from
/openapi.json -- valid ones and invalid ones, boundary values (its coverage phase), the documented
examples and random ones (fuzzing, derandomized) -- and sends them to a real uvicorn server over
the tiny random Llama, with a 32-token context so that generations stay short.

Checks: no 5xx; every status, content type, body (streamed events included) and header as
documented; every body the schema calls invalid refused with a 4xx (negative_data_rejection).
positive_data_acceptance is left out: a schema cannot express that the prompt plus max_tokens must
fit the context, nor the other cross-field rules (stream_options needs stream, top_logprobs needs
logprobs, best_of equals n, min_tokens <= max_tokens) or the vocabulary size, so a body the schema
calls valid may rightly get a 400.
"""

from __future__ import annotations

import collections
import time

import httpx
import pytest
import schemathesis

from specserve.server.openapi import OPERATIONS

CONFIG = schemathesis.Config.from_dict({
    "seed": 20240601,
    "generation": {"mode": "all", "max-examples": 25, "deterministic": True, "database": "none"},
    "phases": {"stateful": {"enabled": False}},
    "checks": {
        "enabled": False,
        "not_a_server_error": {"enabled": True},
        "status_code_conformance": {"enabled": True},
        "content_type_conformance": {"enabled": True},
        "response_schema_conformance": {"enabled": True},
        "response_headers_conformance": {"enabled": True},
        # the 4xx the server answers to a bad request (413 and 429 cannot be told from the body alone)
        "negative_data_rejection": {"enabled": True, "expected-statuses": [400, 401, 404, 413, 429]},
    },
    "request-timeout": 60,
})
MIN_CASES = 500   # this configuration makes ~1700 cases: far fewer means it broke
CASES: collections.Counter = collections.Counter()   # (operation, phase, mode) -> cases sent

COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions")
COMPLETION_ERRORS = {"400", "401", "404", "408", "413", "429", "500", "503"}


@pytest.fixture(scope="module")
def server(serve, make_tiny_engine):
    with serve(make_tiny_engine(max_model_len=32), served_model_name="tiny") as live:
        yield live


@pytest.fixture
def openapi_schema(server):
    start = time.monotonic()
    yield schemathesis.openapi.from_url(server.base_url + "/openapi.json", config=CONFIG)
    total = sum(CASES.values())
    print(f"\nschemathesis: {total} cases in {time.monotonic() - start:.0f} s:",
          ", ".join(f"{op} {phase} {mode}: {n}" for (op, phase, mode), n in sorted(CASES.items())))
    assert total >= MIN_CASES, f"only {total} cases ran: {dict(CASES)}"


@pytest.fixture(autouse=True)
def _node_id(request):
    """schemathesis 4.32's lazy loader reads `request.node._nodeid`, which pytest 9.2 no longer has."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


schema = schemathesis.pytest.from_fixture("openapi_schema")


@schema.parametrize()
def test_every_answer_is_as_documented(case):
    CASES[case.operation.label, case.meta.phase.name.value, case.meta.generation.mode.value] += 1
    case.call_and_validate()


def test_the_document_lists_every_status_and_the_event_stream(server):
    doc = httpx.get(server.base_url + "/openapi.json").json()
    paths = doc["paths"]
    assert {(method, path) for path, item in paths.items() for method in item} == set(OPERATIONS)
    for route in COMPLETION_ROUTES:
        responses = paths[route]["post"]["responses"]
        assert set(responses) == {"200"} | COMPLETION_ERRORS
        ok = responses["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        event = ok["text/event-stream"]["schema"]
        assert "[DONE]" in event["description"] and "data" in event["required"]
    assert set(paths["/v1/models"]["get"]["responses"]) == {"200", "401", "500"}
    assert set(paths["/v1/models/{model_id}"]["get"]["responses"]) == {"200", "401", "404", "500"}
    assert set(paths["/health"]["get"]["responses"]) == {"200", "503"}
    assert set(paths["/tokenize"]["post"]["responses"]) == {"200", "400", "404", "408", "413", "429", "500"}

    schemas, responses = doc["components"]["schemas"], doc["components"]["responses"]
    assert {"ChatCompletionChunk", "CompletionChunk", "ErrorResponse", "ErrorInfo"} <= set(schemas)
    assert "HTTPValidationError" not in schemas          # no 422: validation errors are 400s
    for response in responses.values():
        assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert responses["Unauthorized"]["headers"]["WWW-Authenticate"]["required"]
    # the bounds, exact (FastAPI's own document writes them as floats: 2**63 - 1 became 2**63)
    fields = schemas["CompletionRequest"]["properties"]
    bounds = {name: (fields[name]["anyOf"][0]["minimum"], fields[name]["anyOf"][0]["maximum"])
              for name in ("seed", "top_k", "max_tokens")}
    assert bounds == {"seed": (-2**63, 2**63 - 1), "top_k": (-1, 2**31 - 1), "max_tokens": (1, 2**31 - 1)}
    model = schemas["ChatCompletionRequest"]["properties"]["model"]["anyOf"][0]
    assert "tiny" in model["enum"] and "default" in model["enum"]

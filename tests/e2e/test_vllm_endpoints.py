"""The endpoints and options a vLLM user reaches for, on a real server: GET /version, /ping,
POST /tokenize (a prompt, chat messages) and /detokenize in vLLM's shapes, /v1/completions with
`echo`, CORS (a preflight from an allowed and from a foreign origin; none without the option) and
a root path."""

from __future__ import annotations

import httpx
import openai
import pytest

from specserve.server.cli import build_parser


@pytest.fixture(scope="module")
def server(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny") as live:
        yield live


def post(server, path, **body):
    return httpx.post(server.base_url + path, json=body, timeout=30)


def test_version_and_ping(server):
    version = httpx.get(server.base_url + "/version").json()["version"]
    assert isinstance(version, str) and version
    assert httpx.get(server.base_url + "/ping").status_code == 200
    assert httpx.post(server.base_url + "/ping").status_code == 200


def test_tokenize_and_detokenize_round_trip(server):
    tok = server.engine.tokenizer
    r = post(server, "/tokenize", model="tiny", prompt="Hello world!", return_token_strs=True).json()
    assert r["tokens"] == tok.encode("Hello world!") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == server.engine.max_model_len
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert post(server, "/detokenize", tokens=r["tokens"]).json() == {"prompt": tok.decode(r["tokens"])}
    # chat messages: what a chat completion's prompt becomes
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = post(server, "/tokenize", messages=messages).json()
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False) and chat["token_strs"] is None
    plain = post(server, "/tokenize", messages=messages, add_generation_prompt=False).json()
    assert plain["count"] < chat["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/detokenize", {"tokens": [10 ** 6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
])
def test_bad_tokenize_requests_are_clear_errors(server, path, body, status, param):
    r = post(server, path, **body)
    assert r.status_code == status and r.json()["error"]["param"] == param


def test_completions_echo_the_prompt(server):
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
    prompt = "The quick brown fox"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == prompt + plain
    ids = server.engine.tokenizer.encode(prompt)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == server.engine.tokenizer.decode(ids) + plain
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, logprobs=1)
    assert exc.value.response.json()["error"]["param"] == "echo"


def _preflight(base_url: str, origin: str) -> httpx.Response:
    return httpx.options(base_url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})


def test_cors_only_when_asked_and_only_for_allowed_origins(serve, make_tiny_engine, server):
    assert "access-control-allow-origin" not in _preflight(server.base_url, "https://app.example.com").headers
    cors = dict(allow_origins=["https://app.example.com"], allow_methods=["*"], allow_headers=["*"])
    with serve(make_tiny_engine(), served_model_name="tiny", cors=cors, server_options={"root_path": "/api"}) as live:
        ok = _preflight(live.base_url, "https://app.example.com")
        foreign = _preflight(live.base_url, "https://evil.example.org")
        models = httpx.get(live.base_url + "/v1/models", headers={"Origin": "https://app.example.com"})
        spec = httpx.get(live.base_url + "/openapi.json").json()
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example.com"
    assert foreign.status_code == 400 and "access-control-allow-origin" not in foreign.headers
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == "https://app.example.com"
    assert spec["servers"] == [{"url": "/api"}]      # the prefix a proxy serves it under


def test_the_cli_takes_vllms_flags():
    args = build_parser().parse_args(["serve", "--allowed-origins", '["*"]', "--root-path", "/api",
                                      "--uvicorn-log-level", "warning", "--disable-log-requests",
                                      "--no-vllm-metrics", "--tool-call-parser", "hermes"])
    assert args.allowed_origins == ["*"] and args.allowed_methods == ["*"] and args.root_path == "/api"
    assert args.uvicorn_log_level == "warning" and args.disable_log_requests and not args.vllm_metrics
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--allowed-origins", "https://a.example"])   # not a JSON list

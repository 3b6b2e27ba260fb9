"""Connection hygiene through a real uvicorn server (the launcher `specserve serve` uses) over the tiny
random Llama, with raw sockets where a misbehaving client is the point: a slowloris head or body is
cut off after its timeout while others are served, a client that stops reading its stream is reset
and its request aborted (KV freed), a request on a keep-alive connection open at SIGTERM gets 503
`shutting_down`, every error carries a `code`, long client strings are clipped in messages, and the
integer-valued / vocabulary-range rules of `speculative` options and `stop_token_ids`."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from helpers import slow_steps

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def _connect(server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:    # before connect, so the window it advertises stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", _port(server)))
    return sock


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; (data, seconds waited).
    Fails if the connection is still open after `limit` seconds."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(0.2)
    while time.monotonic() - t0 < limit:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    raise AssertionError(f"the server kept the connection open for {limit} s (got {data[:200]!r})")


def _error_of(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def _chat_ok(server) -> str:
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    return r.choices[0].message.content


# ---- slow clients -----------------------------------------------------------------------------


def test_a_slowloris_head_is_cut_off_after_the_header_timeout_while_others_are_served(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny",
               server_options={"header_timeout": 1.5, "body_timeout": 5.0}) as server:
        assert _chat_ok(server)
        t0 = time.monotonic()
        slow, silent = _connect(server), _connect(server)
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: tiny\r\n")
        stop = threading.Event()

        def trickle():      # one byte of a header every 0.1 s: never a whole head
            try:
                while not stop.is_set():
                    slow.send(b"X")
                    time.sleep(0.1)
            except OSError:
                pass

        closed: list = []

        def read():
            data, _ = _read_until_closed(slow, limit=10)
            closed.append((data, time.monotonic() - t0))

        sender, reader = threading.Thread(target=trickle, daemon=True), threading.Thread(target=read, daemon=True)
        sender.start()
        reader.start()
        try:
            assert _chat_ok(server)                      # served meanwhile, on its own connection
            reader.join(timeout=15)
        finally:
            stop.set()
            sender.join(timeout=5)
        assert closed, "the slowloris connection was never closed"
        data, closed_after = closed[0]
        assert 1.5 <= closed_after < 5.0
        status, err = _error_of(data)
        assert status == 408 and err["code"] == "request_timeout"
        data, waited = _read_until_closed(silent, limit=5)   # connected, never sent a byte: closed, no answer
        assert data == b""
        assert _chat_ok(server)


def test_a_body_sent_too_slowly_is_a_408_and_the_connection_closes(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny",
               server_options={"header_timeout": 5.0, "body_timeout": 1.0}) as server:
        sock = _connect(server)
        body = json.dumps({"messages": CHAT, "max_tokens": 2}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        data, waited = _read_until_closed(sock, limit=5)
        assert 0.9 <= waited < 4.0
        status, err = _error_of(data)
        assert status == 408 and err["code"] == "request_timeout" and "body timeout of 1 s" in err["message"]
        assert b"connection: close" in data.lower()
        assert _chat_ok(server)


def _metric(server, sample: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_client_that_stops_reading_is_reset_and_its_request_aborted(serve, make_tiny_engine, idle):
    """16 choices of 450 tokens with 20 logprobs each (~5 MB of SSE) at 20 ms a step: 9 s to
    generate. The client reads nothing: once the send buffers (~330 KB) are full, the stall timeout
    (1 s) resets the connection and the engine aborts the request, freeing its KV, with most of its
    tokens never generated."""
    engine = make_tiny_engine(max_num_seqs=16)
    slow_steps(engine, 0.02)
    with serve(engine, served_model_name="tiny", server_options={"stream_stall_timeout": 1.0}) as server:
        sock = _connect(server, rcvbuf=4096)
        body = json.dumps({"prompt": "Hello", "max_tokens": 450, "ignore_eos": True, "stream": True, "n": 16,
                           "logprobs": 20}).encode()
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tiny\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        while engine.get_stats().num_running == 0:
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
        assert engine.get_stats().num_free_blocks < engine.get_stats().num_total_blocks
        r = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200                      # others are served while it stalls
        idle(engine, timeout=60)                         # nothing runs, every KV block is free ...
        assert _metric(server, 'specserve_requests_total{status="abort"}') == 1          # ... it was aborted
        assert _metric(server, "specserve_generation_tokens_total") < 16 * 450 / 2      # ... far from its end
        assert _metric(server, "specserve_kv_cache_usage_ratio") == 0
        assert _metric(server, "specserve_num_requests_running") == 0
        with pytest.raises(ConnectionResetError):        # reset by the server, not waiting for a reader
            sock.settimeout(5)
            while sock.recv(65536):
                pass
        sock.close()
        assert _chat_ok(server)


# ---- shutdown ---------------------------------------------------------------------------------


def test_a_request_on_a_keep_alive_connection_open_at_sigterm_gets_503_shutting_down(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny") as server:
        conn = http.client.HTTPConnection("127.0.0.1", _port(server), timeout=10)
        conn.request("GET", "/health")
        first = conn.getresponse()
        assert first.status == 200 and not first.will_close
        first.read()
        server.server.handle_exit(signal.SIGTERM, None)
        deadline = time.monotonic() + 5
        while True:         # the listener closes as the shutdown starts: new connections are refused
            try:
                socket.create_connection(("127.0.0.1", _port(server)), timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < deadline, "the listener stayed open"
            time.sleep(0.02)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({"messages": CHAT, "max_tokens": 2}),
                     headers={"Content-Type": "application/json"})
        second = conn.getresponse()
        err = json.loads(second.read())["error"]
        assert second.status == 503 and err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        assert second.will_close or conn.sock is None or conn.sock.recv(1) == b""   # then closed
        conn.close()
        deadline = time.monotonic() + 15
        while not server.exit_status and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.exit_status == [0]


# ---- error bodies -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ngram_server(serve, make_tiny_engine):
    with serve(make_tiny_engine(drafters=("ngram",)), served_model_name="tiny", max_request_body_bytes=64 * 1024) \
            as server:
        yield server


BAD_REQUESTS = [   # (method, path, body, status, code)
    ("POST", "/v1/chat/completions", {"messages": "hi"}, 400, "invalid_value"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, 400, "unknown_parameter"),
    ("POST", "/v1/chat/completions", {"max_tokens": 2}, 400, "missing_required_parameter"),
    ("POST", "/v1/chat/completions", b'{"messages": [', 400, "invalid_json"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "model_not_found"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 100000}, 400, "context_length_exceeded"),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "speculative": {"drafter": "eagle"}}, 400,
     "drafter_not_loaded"),
    # raised by the engine (InvalidRequestError), once answered with code null
    ("POST", "/v1/completions", {"prompt": [5, 999999], "max_tokens": 2}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "hi", "speculative": {"drafter": "ngram", "max_dept": 2}}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "hi", "speculative": {"drafter": "ngram", "max_depth": "deep"}}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "hi", "speculative": {"drafter": "none", "max_depth": 2}}, 400,
     "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "hi", "stop_token_ids": [320]}, 400, "invalid_value"),
    ("POST", "/v1/completions", {"prompt": "a " * 40000}, 413, "request_too_large"),
    ("GET", "/v1/nothing-here", None, 404, "not_found"),
    ("DELETE", "/v1/models", None, 405, "method_not_allowed"),
]


@pytest.mark.parametrize("method, path, body, status, code", BAD_REQUESTS,
                         ids=[f"{s}-{c}-{i}" for i, (_, _, _, s, c) in enumerate(BAD_REQUESTS)])
def test_every_error_carries_a_code(ngram_server, method, path, body, status, code):
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    r = httpx.request(method, ngram_server.base_url + path, content=content,
                      headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["type"] and err["message"]


def test_long_client_strings_are_clipped_in_error_messages(ngram_server):
    long = "m" * 10_000
    cases = [
        ("/v1/chat/completions", {"messages": CHAT, "model": long}, 404),
        ("/v1/chat/completions", {"messages": CHAT, "speculative": {"drafter": long}}, 400),
        ("/v1/completions", {"prompt": "hi", "speculative": {"drafter": "ngram", long: 2}}, 400),
        ("/v1/completions", {"prompt": "hi", "speculative": {"drafter": "ngram", "max_depth": long}}, 400),
        ("/v1/completions", {"prompt": "hi", long: 1}, 400),
        ("/v1/" + long, {"prompt": "hi"}, 404),
    ]
    for path, body, status in cases:
        r = httpx.post(ngram_server.base_url + path, json=body, timeout=60)
        assert r.status_code == status, r.text[:300]
        err = r.json()["error"]
        assert len(err["message"]) < 700, (path, err["message"][:100])
        assert "m" * 200 in err["message"] and "m" * 257 not in err["message"]   # cut at 256 characters
        assert "more characters]" in err["message"]
        assert err["param"] is None or len(err["param"]) < 400
        assert err["code"]


def test_whole_number_floats_in_speculative_options_are_integers(ngram_server, idle):
    def post(spec, **more):
        return httpx.post(ngram_server.v1 + "/completions", timeout=60, json={
            "prompt": "Hello world Hello world", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "speculative": spec, **more})

    exact = post({"drafter": "ngram", "max_depth": 4, "max_matches": 2})
    assert exact.status_code == 200, exact.text
    as_float = post({"drafter": "ngram", "max_depth": 4.0, "max_matches": 2.0}, max_tokens=6.0)
    assert as_float.status_code == 200, as_float.text
    assert as_float.json()["choices"][0]["text"] == exact.json()["choices"][0]["text"]
    for key in ("max_depth", "max_matches"):
        bad = post({"drafter": "ngram", key: 4.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == f"speculative.{key}", bad.text
    idle(ngram_server.engine)


def test_stop_token_ids_outside_the_vocabulary_are_a_400_naming_the_param(ngram_server):
    def post(ids):
        return httpx.post(ngram_server.v1 + "/completions", timeout=60,
                          json={"prompt": "hi", "max_tokens": 2, "stop_token_ids": ids})

    assert post([0, 319]).status_code == 200                 # the tiny vocabulary is [0, 320)
    for ids, param in (([320], "stop_token_ids.0"), ([5, 2**31 - 1], "stop_token_ids.1"), ([-1], "stop_token_ids.0")):
        r = post(ids)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "invalid_value"

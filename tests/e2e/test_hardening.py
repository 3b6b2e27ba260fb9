"""No request can take the server down, stall it, or get a 500 it did not cause: each reproduction
that once did, through a real uvicorn server over the tiny random Llama, plus fault injection (a
step raising for one request), engine death, graceful shutdown and the process's exit status."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from helpers import slow_steps, sse_events

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MARK = [3, 3, 3, 3, 3, 3, 3]          # prompt token ids of the request a fault is injected into


def metric(base_url: str, sample: str, default: float | None = None) -> float:
    """The value of one exposed sample, e.g. 'specserve_requests_total{status="error"}'."""
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.rsplit(" ", 1)[1])
    if default is None:
        raise KeyError(sample)
    return default


async def stream_completion(ac: httpx.AsyncClient, body: dict) -> tuple[int, list]:
    async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return r.status_code, [json.loads(await r.aread())]
        return 200, sse_events([line async for line in r.aiter_lines()])


# ---- the reproductions ----------------------------------------------------------------------------


def test_a_huge_top_k_is_a_400_and_the_engine_lives_on(tiny_server, http, idle):
    """Once: 503 'the engine loop died: ValueError(Overflow when unpacking long long)' for everyone."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0.8,
                                           "top_k": 9223372036854775808})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_k"
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0.8, "top_k": 2**31 - 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"]
    assert tiny_server.engine.is_alive


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":4}'),
    ("/v1/chat/completions", '{"messages":[{"role":"user","content":[{"type":"text","text":"a\\udfffb"}]}]}'),
    ("/v1/completions", '{"prompt":"hi \\ud800","max_tokens":4}'),
    ("/v1/completions", '{"prompt":"hi","stop":["\\udc00"],"max_tokens":4}'),
])
def test_text_that_cannot_be_encoded_is_a_400(http, route, body):
    """Once: 500 'internal server error: TypeError' from the tokenizer."""
    r = http.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"]


def test_a_body_over_the_limit_is_a_413_by_content_length_or_as_it_streams(serve, make_tiny_engine):
    """Once: a 10 MB chat message was parsed, templated and tokenized on the event loop for 16.7 s."""
    with serve(make_tiny_engine(), max_request_body_bytes=1_000_000) as server:
        big = json.dumps({"messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            r = c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert r.json()["error"]["code"] == "request_too_large"

            def chunks():   # no Content-Length: the limit applies as the body streams in
                for i in range(0, len(big), 65536):
                    yield big[i:i + 65536]
            r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert c.get("/health").status_code == 200
            small = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert small.status_code == 200


def test_health_and_streams_go_on_while_a_huge_prompt_is_tokenized(serve, make_tiny_engine):
    """Tokenization runs off the event loop: while it is held inside the tokenizer, /health answers and a
    stream already running keeps producing. (Were it on the loop, /health would wait for the release,
    which this test only gives after /health answered.)"""
    engine = make_tiny_engine()
    tokenizer = engine.tokenizer
    inside, release = threading.Event(), threading.Event()
    encode = tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if len(text) > 2_000:
            inside.set()
            release.wait(30)
        return encode(text, *args, **kwargs)

    tokenizer.encode = held_encode
    with serve(engine) as server, httpx.Client(base_url=server.base_url, timeout=10) as c:
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            result = {}
            big = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
                server.v1 + "/chat/completions", timeout=60,
                json={"messages": [{"role": "user", "content": "word " * 600}]})))   # 1,800 tokens
            big.start()
            assert inside.wait(30)
            try:
                assert c.get("/health").status_code == 200
                got = [line for _, line in zip(range(20), lines) if line.startswith("data: ")]
                assert len(got) >= 5    # the stream moved on while the tokenizer was held
            finally:
                release.set()
            big.join(60)
        r = result["r"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body", [
    {"prompt": "hi", "max_tokens": "8"},
    {"prompt": "hi", "max_tokens": 8.5},
    {"prompt": "hi", "stream": "true"},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": "hi", "response_format": {"type": "xml"}},
])
def test_contract_bodies_openai_refuses_are_400s(http, body):
    route = "/v1/chat/completions" if "response_format" in body else "/v1/completions"
    if route.endswith("chat/completions"):
        body = {"messages": CHAT, **{k: v for k, v in body.items() if k != "prompt"}}
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_405_names_the_allowed_methods(http):
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    assert r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


# ---- fault injection ------------------------------------------------------------------------------


def _inject_fault(async_engine, exc_factory):
    """Make the engine's forward raise `exc_factory()` whenever its batch holds a MARK-prompt request."""
    runner = async_engine.engine.runner
    execute = runner.execute

    def faulty(batch, *args, **kwargs):
        if any(seq.token_ids[:len(MARK)] == MARK for seq in batch.seqs):
            raise exc_factory()
        return execute(batch, *args, **kwargs)

    runner.execute = faulty


def test_a_step_raising_for_one_request_fails_it_alone(serve, make_tiny_engine, idle):
    engine = make_tiny_engine()
    _inject_fault(engine, lambda: IndexError("index out of range in self"))

    async def run(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as ac:
            good = [stream_completion(ac, {"prompt": f"Hello {i}", "max_tokens": 60, "ignore_eos": True})
                    for i in range(3)]
            bad_stream = stream_completion(ac, {"prompt": MARK, "max_tokens": 60})
            bad_full = ac.post("/v1/completions", json={"prompt": MARK + [4], "max_tokens": 60})
            return await asyncio.gather(*good, bad_stream, bad_full)

    with serve(engine) as server:
        errors_before = metric(server.base_url, 'specserve_requests_total{status="error"}', 0.0)
        *good, (bad_code, bad_events), bad_full = asyncio.run(run(server.base_url))
        for code, events in good:
            assert code == 200 and events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) > 0 for e in events[:-1]) >= 1
        assert bad_code == 200 and bad_events[-1] == "[DONE]"
        err = bad_events[-2]["error"]
        assert err["type"] == "server_error" and err["code"] == "request_failed" and "IndexError" in err["message"]
        assert bad_full.status_code == 500
        assert bad_full.json()["error"]["code"] == "request_failed"
        assert httpx.get(server.base_url + "/health").status_code == 200
        idle(engine)
        assert engine.is_alive
        assert metric(server.base_url, "specserve_engine_failed_requests_total") == 2
        assert metric(server.base_url, 'specserve_requests_total{status="error"}') == errors_before + 2
        ok = httpx.post(server.v1 + "/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=60)
        assert ok.status_code == 200


def test_an_unrecoverable_device_error_kills_the_engine_and_the_process_exits_1(serve, make_tiny_engine):
    engine = make_tiny_engine()
    _inject_fault(engine, lambda: RuntimeError("CUDA error: an illegal memory access was encountered"))
    with serve(engine) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as c:
            code, events = asyncio.run(_one_stream(server.base_url, {"prompt": MARK, "max_tokens": 20}))
            assert events[-2]["error"]["code"] == "engine_dead"
            assert engine.dead.is_set() and not engine.is_alive
            deadline = time.monotonic() + 20
            while not server.exit_status and time.monotonic() < deadline:   # the server shuts itself down
                time.sleep(0.05)
            assert server.exit_status == [1]
            with pytest.raises(httpx.TransportError):
                c.get("/health")


async def _one_stream(base_url, body):
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as ac:
        return await stream_completion(ac, body)


# ---- shutdown -------------------------------------------------------------------------------------


def test_draining_refuses_new_requests_and_lets_running_ones_finish(serve, make_tiny_engine):
    from specserve.server.app import begin_shutdown

    engine = make_tiny_engine()
    slow_steps(engine, 0.01)
    with serve(engine) as server, httpx.Client(base_url=server.base_url, timeout=60) as c:
        body = {"prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            begin_shutdown(server.app, None)        # what SIGTERM does first
            health = httpx.get(server.base_url + "/health")
            assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
            refused = httpx.post(server.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            events = sse_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_shutdown_ends_a_stream_outliving_the_timeout_with_an_error_and_exits_0(serve, make_tiny_engine, idle):
    engine = make_tiny_engine()
    slow_steps(engine, 0.05)                       # 400 tokens: 20 s, far past the 1 s timeout
    with serve(engine, shutdown_timeout=1.0) as server:
        body = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                                json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            t0 = time.monotonic()
            server.server.handle_exit(signal.SIGTERM, None)
            try:       # readiness fails at once: 503, or no connection once the listening socket is closed
                health = httpx.get(server.base_url + "/health", timeout=5).status_code
            except httpx.TransportError:
                health = None
            assert health in (None, 503)
            events = sse_events(lines)
            waited = time.monotonic() - t0
        assert events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["code"] == "shutting_down" and err["type"] == "service_unavailable_error"
        assert 1.0 <= waited < 10
        tokens = sum(len(e["choices"][0]["text"]) > 0 for e in events if isinstance(e, dict) and "choices" in e)
        assert 0 < tokens < 400
        deadline = time.monotonic() + 20
        while not server.exit_status and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.exit_status == [0]
        assert engine.get_stats().num_free_blocks == engine.get_stats().num_total_blocks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specserve.server", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})


def test_sigterm_drains_streams_and_the_process_exits_0(tiny_llama_dir):
    """Once: streams drained, but the process exited with status 143 (uvicorn re-raised the signal);
    and a request arriving right after the signal was refused at the connection, not answered 503."""
    port = _free_port()
    proc = _spawn(["serve", "--model", str(tiny_llama_dir), "--port", str(port), "--dtype", "float32",
                   "--device", "cpu", "--shutdown-timeout", "20", "--log-level", "warning"])
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)

        async def streams():
            async with httpx.AsyncClient(base_url=base, timeout=60) as ac:
                tasks = [asyncio.create_task(stream_completion(ac, {"prompt": f"Hi {i}", "max_tokens": 200,
                                                                     "ignore_eos": True})) for i in range(4)]
                # the signal once all four are in the engine (under a loaded suite they can take seconds
                # to arrive; a server with nothing in flight closes its socket at once, as it should)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    metrics = (await ac.get("/metrics")).text
                    running = sum(float(line.split()[-1]) for line in metrics.splitlines()
                                  if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
                    if running >= 4:
                        break
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with httpx.AsyncClient(base_url=base, timeout=10) as fresh:   # a new connection
                    late = await fresh.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
                return late, await asyncio.gather(*tasks)

        late, results = asyncio.run(streams())
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        for code, events in results:
            assert code == 200 and events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bfloat16_generation_on_a_cpu_without_a_bf16_inner_product(tiny_llama_dir):
    """Once: `specserve generate --dtype bfloat16` killed the engine loop on an AVX2-only x86-64 CPU.
    oneDNN is limited to AVX2 here (ONEDNN_MAX_CPU_ISA), whatever this machine has."""
    proc = _spawn(["generate", "Hello", "--model", str(tiny_llama_dir), "--dtype", "bfloat16", "--device", "cpu",
                   "--max-tokens", "5", "--ignore-eos"], env={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert "5 generated" in out


def test_the_default_model_without_native_kernels_or_bf16_is_served_unquantized(default_model):
    """`--quantization auto` serves the GGUF's int4 where the native CPU kernels build or the CPU
    has native bf16: elsewhere torch's packed kernels would take fp32 activations and run slower
    than the fp32 weights. Here the native kernels are off and oneDNN and ATen are limited to AVX2,
    whatever this machine has."""
    proc = _spawn(["generate", "Hello", "--max-tokens", "5", "--ignore-eos", "--log-level", "info", "--max-num-seqs", "1",
                   "--max-model-len", "128", "--no-prepack-weights", "--drafter", "none"],
                  env={"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "SPECSERVE_CPU_KERNELS": "0"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "5 generated" in out
    assert "quantized 0 MiB" in out and "KV blocks of 16 tokens (float32)" in out


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000, '{"prompt": "hi", "max_tokens": ' + "9" * 5000 + "}"])
def test_a_body_json_cannot_read_is_a_400_invalid_json(http, body):
    r = http.post("/v1/completions", content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_json"

"""The OpenAI API end to end: a real uvicorn server over the real engine (tiny random Llama, fp32,
CPU), driven by the real `openai` client and by raw httpx where the client would hide the wire."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from helpers import sse_events

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.v1, api_key="x", max_retries=0, timeout=60)


def chat_prompt_len(engine, messages) -> int:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def scrape(base_url: str) -> dict[str, float]:
    """/metrics as {"name{label=value,...}": value}."""
    text = httpx.get(base_url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


# ---- models, health ------------------------------------------------------------------------------


def test_models(client, tiny_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].owned_by == "specserve"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_health(http):
    r = http.get("/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


# ---- chat ----------------------------------------------------------------------------------------


def test_chat_non_stream(client, tiny_server):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert len(r.choices) == 1
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == chat_prompt_len(tiny_server.engine, CHAT)
    assert 1 <= r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_model_alias_default_and_omitted(tiny_server, http):
    for body in ({"model": "default"}, {}):
        r = http.post("/v1/chat/completions", json={**body, "messages": CHAT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "tiny"


def test_chat_stream_equals_non_stream_greedy(client):
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert all(c.usage is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_chat_stream_include_usage(client, tiny_server):
    kwargs = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(http):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.split("\n\n") if block)


def test_chat_n2(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=3, n=2,
                                       extra_body=NO_EOS)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                                                 n=2, stream=True, extra_body=NO_EOS))
    texts = {0: "", 1: ""}
    roles = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
    assert roles == {0, 1}
    assert texts == {c.index: c.message.content for c in r.choices}   # same seed, same text


def test_seed_reproducible(client):
    def sample(seed):
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20, temperature=1.0, seed=seed,
                                           extra_body=NO_EOS)
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_max_tokens_gives_length(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 3


def test_default_max_tokens_fills_the_context(client, tiny_server):
    r = client.completions.create(model="tiny", prompt=[5] * 500, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == tiny_server.engine.max_model_len - 500


def test_stop_string(client):
    full = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=30, temperature=0,
                                     extra_body=NO_EOS).choices[0].text
    candidates = [full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].isascii() and full[i:i + 2].strip()]
    assert candidates, f"no usable stop string in {full!r}"
    stop = candidates[0]
    r = client.completions.create(model="tiny", prompt="The quick brown", max_tokens=30, temperature=0, stop=[stop],
                                  extra_body=NO_EOS)
    choice = r.choices[0]
    assert choice.text == full[:full.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_chat_logprobs(client, tiny_server):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0 and isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined == r.choices[0].message.content
    # no logprobs unless asked; logprobs without top_logprobs gives empty lists
    assert client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices[0].logprobs is None
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_chat_logprobs_stream(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True, extra_body=NO_EOS))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == 5 and all(len(e.top_logprobs) == 2 for e in entries)


# ---- completions ---------------------------------------------------------------------------------


def test_completions_stream_and_non_stream(client):
    full = client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    choice = full.choices[0]
    assert choice.finish_reason in ("stop", "length") and isinstance(choice.text, str)
    chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [choice.finish_reason]


def test_completions_prompt_forms_agree(client, tiny_server):
    ids = tiny_server.engine.tokenizer.encode("Hello world")
    texts = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0).choices[0].text
             for p in ("Hello world", ["Hello world"], ids, [ids])]
    assert len(set(texts)) == 1


def test_completions_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model="tiny", prompt="Hello world", max_tokens=6, temperature=0,
                                            logprobs=2, stream=True, extra_body=NO_EOS))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


# ---- errors --------------------------------------------------------------------------------------


def error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_temperature(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=5)
    err = error_of(exc.value)
    assert exc.value.status_code == 400 and err["param"] == "temperature" and err["type"] == "invalid_request_error"


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    err = error_of(exc.value)
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]


def test_prompt_too_long(client, tiny_server):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt=[5] * 600, max_tokens=4)
    err = error_of(exc.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:   # fits alone, not with max_tokens
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=tiny_server.engine.max_model_len)
    err = error_of(exc.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"


def test_malformed_json(http):
    r = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [', 
                  headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    r = http.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_unknown_field(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"temprature": 0})
    err = error_of(exc.value)
    assert err["param"] == "temprature" and "Unrecognized request argument" in err["message"]


def test_engine_side_validation_becomes_400(client):
    with pytest.raises(openai.BadRequestError) as exc:   # token ids outside the vocabulary
        client.completions.create(model="tiny", prompt=[10**6], max_tokens=2)
    assert error_of(exc.value)["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as exc:   # min_tokens > max_tokens: SamplingParams says no
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"min_tokens": 5})
    assert error_of(exc.value)["param"] == "min_tokens"


def test_unloaded_drafter(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"speculative": {"drafter": "eagle"}})
    err = error_of(exc.value)
    assert err["param"] == "speculative.drafter" and "loaded drafters" in err["message"]
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                       extra_body={"speculative": {"drafter": "none"}})
    assert r.choices[0].message.content is not None


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ---- metrics -------------------------------------------------------------------------------------


def test_metrics(client, tiny_server, idle):
    before = scrape(tiny_server.base_url)
    client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, extra_body=NO_EOS)
    list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, stream=True, extra_body=NO_EOS))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=CHAT, temperature=9)
    idle(tiny_server.engine)
    after = scrape(tiny_server.base_url)

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta('specserve_requests_total{status=length}') == 2
    assert delta('specserve_requests_total{status=rejected}') == 1
    assert delta("specserve_generation_tokens_total") == 12
    assert delta("specserve_prompt_tokens_total") == 2 * chat_prompt_len(tiny_server.engine, CHAT)
    assert delta("specserve_request_generation_tokens_total{drafter=none}") == 12     # plain decoding
    assert delta("specserve_time_to_first_token_seconds_count{drafter=none}") == 2
    assert delta("specserve_e2e_request_latency_seconds_count{drafter=none}") == 2
    assert delta("specserve_inter_token_latency_seconds_count{drafter=none}") == 2 * 5
    assert 0 < delta("specserve_e2e_request_latency_seconds_sum{drafter=none}") < 60
    assert 0 < delta("specserve_time_to_first_token_seconds_sum{drafter=none}") <= \
        delta("specserve_e2e_request_latency_seconds_sum{drafter=none}")
    assert after["specserve_num_requests_running"] == 0 and after["specserve_num_requests_waiting"] == 0
    assert after["specserve_kv_cache_usage_ratio"] == 0
    assert after["specserve_model_info{max_model_len=512,model=tiny}"] == 1
    weights = after["specserve_memory_bytes{component=weights}"]
    model = tiny_server.engine.engine.model
    assert weights == sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    assert after["specserve_memory_bytes{component=kv_cache}"] > 0
    text = httpx.get(tiny_server.base_url + "/metrics").text
    for name in ("specserve_requests_total", "specserve_time_to_first_token_seconds",
                 "specserve_inter_token_latency_seconds", "specserve_e2e_request_latency_seconds",
                 "specserve_kv_cache_usage_ratio", "specserve_num_requests_running", "specserve_num_requests_waiting"):
        assert f"# HELP {name.removesuffix('_total')}" in text


def test_kv_usage_gauge_while_running(tiny_server, idle):
    async def run():
        async with httpx.AsyncClient(base_url=tiny_server.base_url, timeout=60) as ac:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 300, "stream": True, **NO_EOS}
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                async for _ in r.aiter_lines():
                    break
                m = scrape(tiny_server.base_url)
                assert m["specserve_num_requests_running"] == 1 and m["specserve_kv_cache_usage_ratio"] > 0

    asyncio.run(run())
    idle(tiny_server.engine)


# ---- disconnects and back-pressure ----------------------------------------------------------------


def test_stream_disconnect_aborts_the_request(tiny_server, idle):
    engine = tiny_server.engine
    before = scrape(tiny_server.base_url).get("specserve_requests_total{status=abort}", 0)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 450, "stream": True, **NO_EOS}
    with httpx.Client(base_url=tiny_server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:     # the role chunk, then two token chunks
                    break
            assert engine.get_stats().num_running == 1
        # leaving the block closes the connection mid-stream
    stats = idle(engine, timeout=5)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert scrape(tiny_server.base_url)["specserve_requests_total{status=abort}"] == before + 1


def test_non_stream_disconnect_aborts_the_request(tiny_server, idle):
    engine = tiny_server.engine
    before = scrape(tiny_server.base_url).get("specserve_requests_total{status=abort}", 0)
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 450, **NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    idle(engine, timeout=5)
    assert scrape(tiny_server.base_url)["specserve_requests_total{status=abort}"] == before + 1


def test_queue_full_gives_429(serve, make_tiny_engine, idle):
    engine = make_tiny_engine(max_num_seqs=1, max_queue_len=1)

    async def one(ac: httpx.AsyncClient) -> tuple[int, dict | None]:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "stream": True, **NO_EOS}
        async with ac.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return r.status_code, json.loads(await r.aread())
            events = sse_events([line async for line in r.aiter_lines()])
            assert events[-1] == "[DONE]"
            return 200, None

    async def burst(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as ac:
            return await asyncio.gather(*[one(ac) for _ in range(6)])

    with serve(engine, served_model_name="tiny") as server:
        results = asyncio.run(burst(server.base_url))
        codes = sorted(code for code, _ in results)
        assert codes.count(200) >= 1 and codes.count(429) >= 1, codes
        assert set(codes) == {200, 429}
        err = next(body for code, body in results if code == 429)["error"]
        assert err["type"] == "rate_limit_error" and err["message"]
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)
        idle(engine)
        assert client.completions.create(model="tiny", prompt="Hello", max_tokens=2).choices   # recovers
        m = scrape(server.base_url)
        assert m["specserve_requests_total{status=rejected}"] == codes.count(429)


async def _burst(base_url: str, size: int, max_tokens: int) -> list[httpx.Response]:
    """`size` streamed completions sent at once (a barrier holds them until every connection is up)."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "stream": True, **NO_EOS}
    limits = httpx.Limits(max_connections=size + 4, max_keepalive_connections=size + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as ac:
        await asyncio.gather(*[ac.get("/health") for _ in range(size)])   # open the connections first
        gate = asyncio.Event()

        async def one() -> httpx.Response:
            await gate.wait()
            async with ac.stream("POST", "/v1/completions", json=body) as r:
                await r.aread()
                return r

        tasks = [asyncio.create_task(one()) for _ in range(size)]
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(*tasks)


def test_burst_into_free_slots_gets_no_429(serve, make_tiny_engine, idle):
    """max_num_seqs + max_queue_len requests sent at once: the free slots take max_num_seqs of them,
    the queue the rest -- none is refused (only requests that cannot be scheduled soon count as queued)."""
    engine = make_tiny_engine(max_num_seqs=8, max_queue_len=2)
    with serve(engine, served_model_name="tiny") as server:
        responses = asyncio.run(_burst(server.base_url, 8 + 2, max_tokens=40))
        assert [r.status_code for r in responses] == [200] * 10
        for r in responses:
            events = sse_events(r.text.splitlines())
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        idle(engine)
        assert scrape(server.base_url).get("specserve_requests_total{status=rejected}", 0) == 0


def test_burst_beyond_the_queue_gets_429_with_retry_after(serve, make_tiny_engine, idle):
    """Beyond max_num_seqs + max_queue_len the extra requests get 429 queue_full, each with an integer
    Retry-After of at least 1 s; the openai client sees it on its RateLimitError."""
    engine = make_tiny_engine(max_num_seqs=2, max_queue_len=2)
    with serve(engine, served_model_name="tiny") as server:
        responses = asyncio.run(_burst(server.base_url, 10, max_tokens=200))
        codes = [r.status_code for r in responses]
        assert codes.count(200) >= 4 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
        for r in responses:
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "queue_full"
                assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1, r.headers
            else:
                assert "retry-after" not in r.headers
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)
        idle(engine)
        engine.add_request = _always_full   # the engine's estimate travels as the header
        with pytest.raises(openai.RateLimitError) as exc:
            client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert exc.value.response.headers["retry-after"] == "7"
        assert error_of(exc.value)["code"] == "queue_full"


def _always_full(*args, **kwargs):
    from specserve.engine.errors import QueueFullError
    raise QueueFullError("the server is busy; retry later", retry_after=7)


# ---- api key, dead engine -------------------------------------------------------------------------


def test_api_key(serve, make_tiny_engine):
    with serve(make_tiny_engine(), served_model_name="tiny", api_key="sekret") as server:
        with pytest.raises(openai.AuthenticationError) as exc:
            openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
        assert error_of(exc.value)["code"] == "invalid_api_key"
        r = httpx.post(server.v1 + "/chat/completions", json={"messages": CHAT})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        ok = openai.OpenAI(base_url=server.v1, api_key="sekret", max_retries=0)
        assert ok.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices
        assert httpx.get(server.base_url + "/health").status_code == 200       # probes need no key
        assert httpx.get(server.base_url + "/metrics").status_code == 200


def test_api_key_from_environment(serve, make_tiny_engine, monkeypatch):
    monkeypatch.setenv("SPECSERVE_API_KEY", "from-env")
    with serve(make_tiny_engine(), served_model_name="tiny") as server:
        assert httpx.get(server.v1 + "/models").status_code == 401
        assert httpx.get(server.v1 + "/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_dead_engine(serve, make_tiny_engine, monkeypatch):
    from specserve.engine.errors import EngineDeadError

    engine = make_tiny_engine()
    with serve(engine, served_model_name="tiny") as server:
        def dead(*args, **kwargs):
            raise EngineDeadError("the engine loop died: boom")

        monkeypatch.setattr(engine, "add_request", dead)
        r = httpx.post(server.v1 + "/chat/completions", json={"messages": CHAT})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        engine.shutdown()
        r = httpx.get(server.base_url + "/health")
        assert r.status_code == 503 and "error" in r.json()


# ---- the real default model ------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_knows_paris(default_model, serve):
    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.config import EngineConfig
    from specserve.engine.core import LLMEngine

    config = EngineConfig(model="default", dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=2)
    engine = AsyncEngine(LLMEngine(config, loaded=default_model))
    with serve(engine) as server:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120)
        start = time.monotonic()
        # "in one word": without it the first token is a near-tie (The 25.33 / L 25.24 in fp32
        # transformers) that int8 activations, the default here as in llama-server, tip to "L'Étoile..."
        question = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
        r = client.chat.completions.create(model="default", messages=question, max_tokens=40, temperature=0)
        text = r.choices[0].message.content
        assert "Paris" in text, text
        assert r.model == engine.model_name and time.monotonic() - start < 120


# ---- speculative decoding ----------------------------------------------------------------------------


def test_speculative_drafter_per_request(serve, make_tiny_engine, idle):
    engine = make_tiny_engine(drafters=("none", "ngram"))       # plain decoding stays the default
    prompt = "Hello world Hello world Hello world Hello world"
    with serve(engine, served_model_name="tiny") as server:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0)

        def run(**extra):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                             extra_body={**NO_EOS, **extra})

        plain, spec = run(), run(speculative={"drafter": "ngram"})
        assert spec.choices[0].text == plain.choices[0].text          # lossless under greedy
        assert "speculative" not in plain.model_extra
        block = spec.model_extra["speculative"]
        assert block["drafter"] == "ngram" and block["target_forwards"] >= 1
        assert 0 <= block["accepted_tokens"] <= block["draft_tokens"]
        assert block["mean_accepted_length"] == pytest.approx(40 / block["target_forwards"], rel=1e-3)
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={**NO_EOS, "speculative": {"drafter": "ngram"}}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
        assert chunks[-1].model_extra["speculative"]["drafter"] == "ngram"
        with pytest.raises(openai.BadRequestError) as exc:
            run(speculative={"drafter": "eagle"})
        assert "loaded drafters: none, ngram" in error_of(exc.value)["message"]
        idle(engine)
        m = scrape(server.base_url)
        assert m["specserve_spec_decode_verification_steps_total{drafter=ngram}"] >= 1
        assert m["specserve_spec_decode_draft_tokens_total{drafter=ngram}"] >= \
            m["specserve_spec_decode_accepted_tokens_total{drafter=ngram}"]
        assert m["specserve_spec_decode_accepted_length_count{drafter=ngram}"] == \
            m["specserve_spec_decode_verification_steps_total{drafter=ngram}"]
        # request-level series carry the request's drafter: 2 plain and 2 ngram requests of 40 tokens
        assert m["specserve_request_generation_tokens_total{drafter=none}"] == 40
        assert m["specserve_request_generation_tokens_total{drafter=ngram}"] == 2 * 40
        assert m["specserve_time_to_first_token_seconds_count{drafter=ngram}"] == 2
        assert m["specserve_e2e_request_latency_seconds_count{drafter=none}"] == 1
        # `position` is bounded by the tree depth (--num-speculative-tokens, 8 by default) and exported from 1 on
        positions = {k for k in m if k.startswith("specserve_spec_decode_accepted_tokens_per_position_total")}
        # (per drafter: the loaded ones and `grammar`, structured output's forced tokens)
        assert positions == {f"specserve_spec_decode_accepted_tokens_per_position_total{{drafter={name},position={d}}}"
                             for name in ("ngram", "grammar") for d in range(1, 9)}

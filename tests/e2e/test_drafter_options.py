"""Per-request drafter options through a real server: the `speculative` block's keys beyond
`drafter` reach the drafter when it declares them per request, and are an OpenAI-style 400
(`invalid_request_error`, param `speculative.<key>`) naming the valid ones otherwise."""

from __future__ import annotations

import httpx


def _post(server, **body):
    payload = {"model": "tiny", "prompt": "Hello world Hello world Hello world", "max_tokens": 12,
               "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(f"{server.v1}/completions", json=payload, timeout=120)


def test_per_request_drafter_options(serve, make_tiny_engine, idle):
    engine = make_tiny_engine(drafters=("ngram",))
    with serve(engine, served_model_name="tiny") as server:
        plain = _post(server, speculative={"drafter": "none"})
        assert plain.status_code == 200
        text = plain.json()["choices"][0]["text"]
        for spec in ({"drafter": "ngram", "max_depth": 2}, {"max_depth": 1, "max_matches": 1}):
            ok = _post(server, speculative=spec)
            assert ok.status_code == 200, ok.text
            assert ok.json()["choices"][0]["text"] == text              # still lossless
            assert ok.json()["speculative"]["drafter"] == "ngram"
        bad = _post(server, speculative={"drafter": "ngram", "max_dept": 2})
        assert bad.status_code == 400
        err = bad.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "speculative.max_dept"
        assert "did you mean 'max_depth'" in err["message"] and "max_depth, max_matches" in err["message"]
        engine_wide = _post(server, speculative={"drafter": "ngram", "max_ngram": 2})
        assert engine_wide.status_code == 400 and engine_wide.json()["error"]["param"] == "speculative.max_ngram"
        value = _post(server, speculative={"drafter": "ngram", "max_depth": "deep"})
        assert value.status_code == 400 and value.json()["error"]["param"] == "speculative.max_depth"
        none = _post(server, speculative={"drafter": "none", "max_depth": 2})
        assert none.status_code == 400 and none.json()["error"]["param"] == "speculative.max_depth"
        idle(engine)

"""The OpenAI sampling surface through the real `openai` client and a real server: penalties,
logit_bias, repetition_penalty and min_p are honoured, give the same greedy text with a drafter as
without one, and out-of-range values are 400s naming the parameter."""

from __future__ import annotations

import openai
import pytest

CHAT = [{"role": "user", "content": "Count: one two three one two three one two"}]
PENALTIES = dict(presence_penalty=0.3, frequency_penalty=0.3)
EXTRA = {"repetition_penalty": 1.5, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve, make_tiny_engine):
    engine = make_tiny_engine(drafters=("ngram", "draft_model"), draft_budget="fixed",
                              drafter_options={"draft_model": {"draft_layers": 1, "k_config": "3,2,1"}})
    with serve(engine, served_model_name="tiny") as live:
        yield live


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=60)


def greedy(client, drafter: str | None = None, **fields) -> str:
    extra = {**EXTRA, **fields.pop("extra_body", {})}
    if drafter:
        extra["speculative"] = {"drafter": drafter}
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, extra_body=extra,
                                       **fields)
    return r.choices[0].message.content


def test_penalties_change_the_text_and_every_drafter_keeps_it(client):
    penalised = greedy(client, **PENALTIES)
    assert penalised != greedy(client, extra_body={"repetition_penalty": 1.0})
    for drafter in ("ngram", "draft_model"):
        assert greedy(client, drafter, **PENALTIES) == penalised, drafter


def test_logit_bias_forces_a_token(client, server):
    tok = server.engine.tokenizer
    token = next(t for t in range(3, 320) if tok.decode([t]).strip().isalpha())   # whole characters
    text = greedy(client, "draft_model", logit_bias={str(token): 100}, extra_body={"repetition_penalty": 1.0})
    assert text == tok.decode([token] * 24)


def test_min_p_is_accepted_with_sampling(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=1.0, seed=3,
                                       extra_body={"min_p": 0.2, "ignore_eos": True})
    assert r.usage.completion_tokens == 8


@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 200}}, "logit_bias"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
])
def test_out_of_range_values_are_400s_naming_the_parameter(client, fields, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, **fields)
    assert exc.value.response.json()["error"]["param"] == param

"""The OpenAI sampling surface through the real `openai` client and a real server: penalties,
logit_bias, repetition_penalty and min_p are honoured, give the same greedy text with a drafter as
without one, and out-of-range values are 400s naming the parameter; structured output (the client's
`parse` helper with a pydantic model, vLLM's `structured_outputs` and `guided_*`) holds with and
without drafters, and a constraint that does not compile is a 400 naming its field."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pydantic
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


# ---- structured output ------------------------------------------------------------------------------


class City(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    population: Literal[1, 2, 3]


def test_parse_helper_gets_a_validated_object(client):
    # the openai client's helper sends response_format json_schema (strict) and parses the answer
    for drafter in (None, "ngram", "draft_model"):
        r = client.chat.completions.parse(model="tiny", messages=CHAT, response_format=City, max_tokens=200,
                                          temperature=0, extra_body={"speculative": {"drafter": drafter or "none"}})
        assert isinstance(r.choices[0].message.parsed, City), r.choices[0].message.content


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "a" [0-9] [0-9]'}, lambda t: re.fullmatch("a[0-9]{2}", t)),
])
def test_constraints_hold_with_and_without_a_drafter(client, extra, check):
    texts = set()
    for drafter in ("none", "ngram", "draft_model"):
        r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=0,
                                           extra_body={**extra, "speculative": {"drafter": drafter}})
        assert r.choices[0].finish_reason == "stop" and check(r.choices[0].message.content), r.choices[0].message
        texts.add(r.choices[0].message.content)
    assert len(texts) == 1


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
])
def test_constraints_that_do_not_compile_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, extra_body=extra)
    assert exc.value.response.json()["error"]["param"] == param


# ---- forced tool calls ----------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


def test_a_named_function_is_called_with_valid_arguments(client):
    seen = set()
    for drafter in ("none", "ngram", "draft_model"):
        r = client.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=60, temperature=0, tools=[WEATHER, NOW],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            extra_body={"speculative": {"drafter": drafter}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        [call] = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        assert args["city"] in ("Paris", "Rome") and args["days"] in (1, 2, 3)
        seen.add(call.function.arguments)
    assert len(seen) == 1       # every drafter: plain decoding's call


def test_required_tool_calls_stream_as_a_delta(client):
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0,
                                            tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False,
                                            stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    [last] = [d for d in deltas if d.finish_reason]
    assert last.finish_reason == "tool_calls"
    [call] = last.delta.tool_calls
    assert call.function.name in ("get_weather", "now") and isinstance(json.loads(call.function.arguments), dict)
    # the same call as the non-streamed answer
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=80, temperature=0, tools=[WEATHER, NOW],
                                       tool_choice="required", parallel_tool_calls=False)
    assert r.choices[0].message.tool_calls[0].function.arguments == call.function.arguments


def test_tool_choice_auto_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, tools=[WEATHER])
    err = exc.value.response.json()["error"]
    assert err["param"] == "tool_choice" and "required" in err["message"]

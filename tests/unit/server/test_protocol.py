"""Request validation and response shapes of the OpenAI schemas (no model, no server)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from specserve.server.app import validation_error
from specserve.server.protocol import (ChatCompletionChunk, ChatChunkChoice, ChatCompletionRequest, ChatDelta,
                                       CompletionRequest, CompletionResponse, CompletionChoice, ErrorInfo,
                                       ErrorResponse, UsageInfo)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def openai_error(exc_info) -> ErrorInfo:
    """The OpenAI error the server would answer for a pydantic ValidationError (loc as FastAPI sends it)."""
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc_info.value.errors()]
    err = validation_error(errors)
    assert err.status_code == 400
    return err.info


# ---- chat --------------------------------------------------------------------------------------


def test_chat_minimal_defaults():
    r = chat()
    assert r.messages[0].text == "hi"
    assert r.n == 1 and r.stream is False and r.requested_max_tokens is None
    assert r.num_logprobs is None and r.include_usage is False and r.stop_list == []


def test_chat_model_is_optional():
    assert ChatCompletionRequest.model_validate({"messages": USER}).model is None


@pytest.mark.parametrize("content, text", [
    ("plain", "plain"),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
    (None, ""),
])
def test_chat_content_forms(content, text):
    r = ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": content}]})
    assert r.messages[0].text == text


def test_chat_image_part_is_rejected_with_param():
    with pytest.raises(ValidationError) as exc:
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    info = openai_error(exc)
    assert info.param == "messages.0.content" and "only text parts" in info.message


def test_chat_needs_a_message():
    with pytest.raises(ValidationError) as exc:
        chat(messages=[])
    assert openai_error(exc).param == "messages"


def test_chat_unknown_role():
    with pytest.raises(ValidationError) as exc:
        chat(messages=[{"role": "wizard", "content": "x"}])
    assert openai_error(exc).param == "messages.0.role"


def test_replayed_assistant_message_is_accepted():
    """A client appending a response's message (with refusal/tool_calls null) must not get a 400."""
    msg = {"role": "assistant", "content": "x", "refusal": None, "tool_calls": None, "annotations": []}
    chat(messages=[*USER, msg, {"role": "user", "content": "more"}])


def test_max_completion_tokens_wins():
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0), ("top_p", 1.5), ("n", 0), ("n", 129),
    ("max_tokens", 0), ("max_completion_tokens", 0), ("top_logprobs", 21), ("min_tokens", -1),
])
def test_chat_out_of_range_names_the_param(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(ValidationError) as exc:
        chat(**{field: value}, **extra)
    info = openai_error(exc)
    assert info.param == field and info.type == "invalid_request_error"
    assert field in info.message and json.dumps(value) in info.message


def test_unknown_field_is_rejected_like_openai():
    with pytest.raises(ValidationError) as exc:
        chat(temprature=0.5)
    info = openai_error(exc)
    assert info.message == "Unrecognized request argument supplied: temprature"
    assert info.param == "temprature" and info.code == "unknown_parameter"


def test_extensions_are_accepted():
    r = chat(top_k=5, min_tokens=1, ignore_eos=True, stop_token_ids=[3], include_stop_str_in_output=True,
             skip_special_tokens=False, speculative={"drafter": "ngram", "max_depth": 4})
    assert r.top_k == 5 and r.ignore_eos and r.stop_token_ids == [3]
    assert r.speculative.drafter == "ngram" and r.speculative.wants_drafter
    assert r.speculative.model_dump() == {"drafter": "ngram", "max_depth": 4}   # drafter options kept as given


@pytest.mark.parametrize("spec, wants", [({}, False), ({"drafter": "none"}, False), ({"drafter": "eagle"}, True)])
def test_speculative_drafter_none_means_off(spec, wants):
    assert chat(speculative=spec).speculative.wants_drafter is wants


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_only_zero(field):
    chat(**{field: 0})
    chat(**{field: 0.0})
    with pytest.raises(ValidationError) as exc:
        chat(**{field: 0.5})
    info = openai_error(exc)
    assert info.param == field and "not supported" in info.message and "Value error" not in info.message


@pytest.mark.parametrize("fields, param", [
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_openai_features_are_clear_400s(fields, param):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert openai_error(exc).param == param


def test_neutral_values_of_unsupported_features_pass():
    chat(logit_bias={}, tools=[], tool_choice="none", response_format={"type": "text"}, user="u", store=False,
         metadata={"k": "v"}, parallel_tool_calls=False)


def test_logprobs_fields():
    assert chat(logprobs=True).num_logprobs == 0
    assert chat(logprobs=True, top_logprobs=3).num_logprobs == 3
    assert chat(logprobs=False).num_logprobs is None
    with pytest.raises(ValidationError) as exc:
        chat(top_logprobs=3)
    info = openai_error(exc)
    assert info.param == "top_logprobs" and "requires logprobs" in info.message


def test_stream_options():
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert chat(stream=True).include_usage is False
    with pytest.raises(ValidationError) as exc:
        chat(stream_options={"include_usage": True})
    assert openai_error(exc).param == "stream_options"
    with pytest.raises(ValidationError) as exc:
        chat(stream=True, stream_options={"include_usag": True})
    assert openai_error(exc).param == "stream_options.include_usag"


@pytest.mark.parametrize("stop, expected", [(None, []), ("x", ["x"]), (["a", "b"], ["a", "b"])])
def test_stop_forms(stop, expected):
    assert chat(stop=stop).stop_list == expected


# ---- completions -------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, single", [
    ("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[1, 2]], [1, 2]),
])
def test_completion_prompt_forms(prompt, single):
    assert completion(prompt=prompt).single_prompt == single


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]]])
def test_batched_prompts_are_rejected(prompt):
    with pytest.raises(ValidationError) as exc:
        completion(prompt=prompt)
    info = openai_error(exc)
    assert info.param == "prompt" and "one prompt per request" in info.message


def test_completion_prompt_required_and_typed():
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"model": "m"})
    info = openai_error(exc)
    assert info.param == "prompt" and info.message.startswith("Missing required parameter")
    with pytest.raises(ValidationError) as exc:
        completion(prompt=12)
    assert openai_error(exc).param == "prompt"


def test_completion_logprobs_is_an_int():
    assert completion(logprobs=2).logprobs == 2
    with pytest.raises(ValidationError) as exc:
        completion(logprobs=21)
    assert openai_error(exc).param == "logprobs"


@pytest.mark.parametrize("fields, param", [({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"),
                                           ({"best_of": 3}, "best_of")])
def test_completion_unsupported(fields, param):
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    assert openai_error(exc).param == param


def test_completion_chat_only_fields_are_unknown():
    with pytest.raises(ValidationError) as exc:
        completion(messages=USER)
    assert openai_error(exc).code == "unknown_parameter"


# ---- errors the server builds from FastAPI's error list ---------------------------------------------


def test_malformed_json_error():
    errors = [{"type": "json_invalid", "loc": ("body", 12), "msg": "JSON decode error",
               "input": {}, "ctx": {"error": "Expecting ',' delimiter"}}]
    info = validation_error(errors).info
    assert info.param is None and "could not parse the JSON" in info.message and "delimiter" in info.message


def test_missing_body_error():
    info = validation_error([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}]).info
    assert info.param is None and "body" in info.message


def test_more_errors_are_mentioned():
    with pytest.raises(ValidationError) as exc:
        chat(temperature=9, top_p=9)
    assert "1 more validation error" in openai_error(exc).message


# ---- responses ---------------------------------------------------------------------------------


def test_chunk_omits_empty_delta_fields_and_usage():
    c = ChatCompletionChunk(id="x", created=1, model="m",
                            choices=[ChatChunkChoice(index=0, delta=ChatDelta(content="hi"))])
    d = json.loads(c.model_dump_json())
    assert d["choices"][0]["delta"] == {"content": "hi"}
    assert d["choices"][0]["finish_reason"] is None and "logprobs" in d["choices"][0]
    assert "usage" not in d and "speculative" not in d
    first = ChatChunkChoice(index=0, delta=ChatDelta(role="assistant", content=""))
    assert first.model_dump()["delta"] == {"role": "assistant", "content": ""}


def test_completion_response_shape():
    r = CompletionResponse(id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="t", finish_reason="stop")],
                           usage=UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    d = r.model_dump(mode="json")
    assert d["object"] == "text_completion" and d["usage"]["total_tokens"] == 3 and "speculative" not in d


def test_error_body_shape():
    d = ErrorResponse(error=ErrorInfo(message="m", type="invalid_request_error")).model_dump()
    assert d == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}

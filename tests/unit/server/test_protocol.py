"""Request validation and response shapes of the OpenAI schemas (no model, no server).

Bodies are validated as FastAPI does it: the Python object `json.loads` makes (which lets NaN,
Infinity and lone surrogates through), in pydantic's Python mode."""

from __future__ import annotations

import json


import pytest
from pydantic import ValidationError

from specserve.server.app import validation_error
from specserve.server.protocol import (MAX_INT32, ChatCompletionChunk, ChatChunkChoice, ChatCompletionRequest,
                                       ChatDelta, CompletionRequest, CompletionResponse, CompletionChoice, ErrorInfo,
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
    err.response()   # the body can be rendered (e.g. it echoes no lone surrogate)
    return err.info


def rejected(model, body: str) -> ErrorInfo:
    """The OpenAI error for a raw JSON `body` of `model`, which must be refused."""
    with pytest.raises(ValidationError) as exc:
        model.model_validate(json.loads(body))
    return openai_error(exc)


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


@pytest.mark.parametrize("field, low, high", [("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                                              ("repetition_penalty", 0.01, 2), ("min_p", 0, 1)])
def test_penalties_and_min_p_take_their_ranges(field, low, high):
    assert getattr(chat(**{field: low}), field) == low and getattr(chat(**{field: high}), field) == high
    for bad in (low - 0.5, high + 0.5):
        with pytest.raises(ValidationError) as exc:
            chat(**{field: bad})
        assert openai_error(exc).param == field


def test_logit_bias_maps_token_ids_to_bounded_biases():
    assert chat(logit_bias={"5": 1.5, "1000": -100}).logit_bias_ids == {5: 1.5, 1000: -100}
    for bad in ({"5": 101}, {"x": 1}, {"-1": 1}, {str(i): 1 for i in range(301)}):
        with pytest.raises(ValidationError) as exc:
            chat(logit_bias=bad)
        assert openai_error(exc).param == "logit_bias"


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {
        "type": "function", "function": {"name": "g"}}}, "tool_choice"),
])
def test_inconsistent_tool_fields_are_clear_400s(fields, param):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert openai_error(exc).param == param


def test_tools_without_a_choice_mean_auto():
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools).tool_mode == "auto" and chat(tools=tools, tool_choice="none").tool_mode is None
    assert chat(tools=tools).tool_schema() is None      # auto: nothing constrains the answer


@pytest.mark.parametrize("fields, guided", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json", '{"type": "object"}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer"},
                                                                  "strict": True}}}, ("json", '{"type": "integer"}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", '["a", "b"]')),
    ({"structured_outputs": {"json": {"type": "object"}}}, ("json", '{"type": "object"}')),
    ({"structured_outputs": {"grammar": "start: /x/"}}, ("grammar", "start: /x/")),
    ({"structured_outputs": {"json_object": True}}, ("json", '{"type": "object"}')),
    ({"guided_json": '{"type": "string"}'}, ("json", '{"type": "string"}')),
    ({"guided_regex": "a|b"}, ("regex", "a|b")),
    ({"guided_choice": ["x"]}, ("choice", '["x"]')),
    ({"guided_grammar": "root ::= \"a\""}, ("grammar", 'root ::= "a"')),
])
def test_output_constraints_in_every_spelling(fields, guided):
    got = chat(**fields).guided()
    assert (got[0] if got else None) == guided


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "a"}}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs.yaml"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "response_format"),
])
def test_conflicting_or_malformed_constraints_are_400s(fields, param):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert openai_error(exc).param == param


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def test_forced_tool_calls_become_json_constraints():
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool_mode == "named" and named.tool_schema() == TOOLS[0]["function"]["parameters"]
    assert named.guided() == (("json", json.dumps(TOOLS[0]["function"]["parameters"])), "tool_choice")
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = required.tool_schema()
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert [a["properties"]["name"] for a in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "now"}]
    assert "maxItems" not in chat(tools=TOOLS, tool_choice="required").tool_schema()
    assert chat(tools=TOOLS, tool_choice="none").guided() is None


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
     "tools.0.function.name"),
])
def test_bad_tool_requests_are_400s(fields, param):
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert openai_error(exc).param == param


def test_tool_calls_and_results_can_be_sent_back():
    call = {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    r = chat(messages=[{"role": "user", "content": "time?"}, {"role": "assistant", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "noon"}])
    assert r.messages[1].template_dict()["tool_calls"] == [call]
    assert r.messages[2].template_dict() == {"role": "tool", "content": "noon", "tool_call_id": "call_1"}
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": "x", "tool_calls": [call]}])


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


@pytest.mark.parametrize("prompt", ["", [], [""], [[]]])
def test_empty_prompts_are_rejected(prompt):
    """The engine refuses them ("the prompt is empty"): the schema says so (minLength, minItems)."""
    with pytest.raises(ValidationError) as exc:
        completion(prompt=prompt)
    info = openai_error(exc)
    assert info.param == "prompt" and "the prompt is empty" in info.message


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


@pytest.mark.parametrize("fields, param", [({"echo": True, "logprobs": 1}, "echo"), ({"suffix": "x"}, "suffix"),
                                           ({"best_of": 3}, "best_of")])
def test_completion_unsupported(fields, param):
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    assert openai_error(exc).param == param


def test_completion_chat_only_fields_are_unknown():
    with pytest.raises(ValidationError) as exc:
        completion(messages=USER)
    assert openai_error(exc).code == "unknown_parameter"


# ---- strict types and bounds -------------------------------------------------------------------


@pytest.mark.parametrize("field, value, expected", [
    ("max_tokens", '"8"', "valid integer"), ("max_tokens", "1.5", "valid integer"),
    ("max_tokens", "true", "valid integer"), ("max_completion_tokens", '"8"', "valid integer"),
    ("n", "2.5", "valid integer"), ("top_k", "false", "valid integer"), ("seed", '"1"', "valid integer"),
    ("min_tokens", "1.5", "valid integer"), ("top_logprobs", "true", "valid integer"),
    ("temperature", '"0.5"', "valid number"), ("top_p", "true", "valid number"),
    ("temperature", "NaN", "finite number"), ("temperature", "Infinity", "finite number"),
    ("top_p", "-Infinity", "finite number"), ("presence_penalty", "NaN", "finite number"),
    ("stream", '"true"', "valid boolean"), ("stream", "1", "valid boolean"),
    ("logprobs", '"false"', "valid boolean"), ("ignore_eos", "0", "valid boolean"),
    ("user", "5", "valid string"), ("model", "7", "valid string"),
])
def test_types_are_strict(field, value, expected):
    info = rejected(ChatCompletionRequest, f'{{"messages": {json.dumps(USER)}, "{field}": {value}}}')
    assert info.param == field and info.code == "invalid_value"
    assert info.message.startswith(f"Invalid value for '{field}': Input should be a {expected}")


@pytest.mark.parametrize("body, param", [
    ('{"stop_token_ids": ["1"]}', "stop_token_ids.0"),
    ('{"stop": [1]}', "stop.0"),
    ('{"prompt": [1, "2"]}', "prompt.1"),
    ('{"prompt": [1, 2.5]}', "prompt.1"),
    ('{"stream_options": {"include_usage": "yes"}, "stream": true}', "stream_options.include_usage"),
    ('{"speculative": {"drafter": 1}}', "speculative.drafter"),
])
def test_strict_types_reach_nested_values(body, param):
    assert rejected(CompletionRequest, json.dumps({"prompt": "hi", **json.loads(body)})).param == param


def test_numbers_are_numbers_as_in_json_schema():
    """A JSON integer is a valid float, and a number without a fractional part a valid integer."""
    r = completion(temperature=1, top_p=1, max_tokens=8.0, seed=-3.0, stop_token_ids=[5.0], prompt=[1.0, 2])
    assert isinstance(r.temperature, float) and isinstance(r.top_p, float)
    assert (r.max_tokens, r.seed, r.stop_token_ids, r.prompt) == (8, -3, [5], [1, 2])
    assert all(type(v) is int for v in (r.max_tokens, r.seed, *r.stop_token_ids, *r.prompt))


def test_a_huge_top_k_is_a_400_naming_it():
    """Once an int64 overflow in the sampler that killed the engine."""
    info = rejected(CompletionRequest, '{"prompt": "hi", "max_tokens": 4, "temperature": 0.8, '
                                       '"top_k": 9223372036854775808}')
    assert info.param == "top_k" and str(MAX_INT32) in info.message and "9223372036854775808" in info.message
    assert completion(top_k=MAX_INT32).top_k == MAX_INT32
    assert completion(top_k=-1).top_k == -1


@pytest.mark.parametrize("field, ok, bad", [
    ("top_k", [-1, 0, MAX_INT32], [-2, MAX_INT32 + 1]),
    ("seed", [-2**63, 0, 2**63 - 1], [-2**63 - 1, 2**63]),
    ("max_tokens", [1, MAX_INT32], [0, MAX_INT32 + 1]),
    ("min_tokens", [0, MAX_INT32], [-1, MAX_INT32 + 1]),
    ("n", [1, 128], [0, 129]),
    ("logprobs", [0, 20], [-1, 21]),
    ("best_of", [1], [0, 129]),
])
def test_numbers_are_bounded(field, ok, bad):
    for value in ok:
        assert getattr(completion(**{field: value}), field) == value
    for value in bad:
        with pytest.raises(ValidationError) as exc:
            completion(**{field: value})
        info = openai_error(exc)
        assert info.param == field and json.dumps(value) in info.message


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_chat_token_limits_are_int32(field):
    assert chat(**{field: MAX_INT32}).requested_max_tokens == MAX_INT32
    with pytest.raises(ValidationError) as exc:
        chat(**{field: MAX_INT32 + 1})
    assert openai_error(exc).param == field


@pytest.mark.parametrize("fields, param, expected", [
    ({"stop_token_ids": [MAX_INT32 + 1]}, "stop_token_ids.0", "less than or equal to 2147483647"),
    ({"stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "at most 64 items"),
    ({"stop": ["x"] * 17}, "stop", "at most 16 items"),
    ({"stop": "x" * 1025}, "stop", "at most 1024 characters"),
    ({"stop": ["ok", "x" * 1025]}, "stop.1", "at most 1024 characters"),
    ({"prompt": [1, MAX_INT32 + 1]}, "prompt.1", "less than or equal to 2147483647"),
    ({"prompt": [[-1]]}, "prompt.0.0", "greater than or equal to 0"),
])
def test_lists_and_token_ids_are_bounded(fields, param, expected):
    with pytest.raises(ValidationError) as exc:
        completion(**fields)
    info = openai_error(exc)
    assert info.param == param and expected in info.message


def test_bounds_in_range_pass():
    r = completion(stop_token_ids=list(range(64)), stop=["x" * 1024] * 16, prompt=[0, MAX_INT32])
    assert len(r.stop_list) == 16 and r.single_prompt == [0, MAX_INT32]


# ---- text that UTF-8 cannot encode -------------------------------------------------------------


LONE = "\ud800"   # what json.loads makes of "\\ud800": a lone surrogate


@pytest.mark.parametrize("model, fields, param", [
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": f"a{LONE}b"}]}]},
     "messages.0.content.0.text"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "name": LONE}]}, "messages.0.name"),
    (ChatCompletionRequest, {"messages": [*USER, {"role": "assistant", "content": "y", "refusal": LONE}]},
     "messages.1.refusal"),
    (ChatCompletionRequest, {"messages": USER, "stop": ["ok", LONE]}, "stop.1"),
    (ChatCompletionRequest, {"messages": USER, "tool_choice": LONE}, "tool_choice"),
    (CompletionRequest, {"prompt": f"hi {LONE}"}, "prompt"),
    (CompletionRequest, {"prompt": [LONE]}, "prompt.0"),
    (CompletionRequest, {"prompt": "hi", "stop": LONE}, "stop"),
    (CompletionRequest, {"prompt": "hi", "user": LONE}, "user"),
    (CompletionRequest, {"prompt": "hi", "model": f"m{LONE}"}, "model"),
    (CompletionRequest, {"prompt": "hi", "suffix": LONE}, "suffix"),
    (CompletionRequest, {"prompt": "hi", "metadata": {"k": LONE}}, "metadata.k"),
    (CompletionRequest, {"prompt": "hi", "metadata": {LONE: "v"}}, "metadata"),
    (CompletionRequest, {"prompt": "hi", "speculative": {"drafter": LONE}}, "speculative.drafter"),
    (CompletionRequest, {"prompt": "hi", "speculative": {"drafter": "ngram", "opts": [LONE]}}, "speculative.opts.0"),
])
def test_text_utf8_cannot_encode_is_a_400_naming_the_param(model, fields, param):
    """Once a 500 from the tokenizer."""
    info = rejected(model, json.dumps(fields))   # json.dumps escapes the surrogate as \\ud800
    assert info.param == param and info.code == "invalid_value"
    assert f"'{param}'" in info.message and "unpaired surrogate" in info.message


def test_an_unencodable_field_name_is_a_400():
    info = rejected(CompletionRequest, json.dumps({"prompt": "hi", LONE: 1}))
    assert info.param is None and "field name" in info.message


def test_surrogate_pairs_and_other_text_pass():
    r = completion(prompt="emoji \U0001F600 \u00e9 \u4e2d", stop=["\U0001F600"])
    assert r.single_prompt.startswith("emoji") and r.stop_list == ["\U0001F600"]
    pair = json.loads('"\\ud83d\\ude00"')   # a surrogate pair in JSON is one character
    assert chat(messages=[{"role": "user", "content": pair}]).messages[0].text == "\U0001F600"


# ---- the schema says what is accepted ----------------------------------------------------------


def _field_schema(model, name: str) -> dict:
    schema = model.model_json_schema()["properties"][name]
    return schema["anyOf"][0] if "anyOf" in schema else schema


@pytest.mark.parametrize("model, name, expected", [
    (CompletionRequest, "suffix", {"type": "string", "maxLength": 0}),
    (CompletionRequest, "best_of", {"type": "integer", "minimum": 1, "maximum": 128}),
    (CompletionRequest, "top_k", {"type": "integer", "minimum": -1, "maximum": MAX_INT32}),
    (ChatCompletionRequest, "response_format", {"$ref": "#/$defs/ResponseFormat"}),
])
def test_neutral_only_fields_say_so_in_the_schema(model, name, expected):
    assert _field_schema(model, name) == expected


def test_prompt_schema_refuses_empty_and_batched_prompts():
    forms = _field_schema(CompletionRequest, "prompt")["oneOf"]
    assert forms[0] == {"type": "string", "minLength": 1}
    assert forms[1]["minItems"] == 1
    assert all(f["minItems"] == f["maxItems"] == 1 for f in forms[2:])


def test_response_format_schema_lists_its_types():
    defs = ChatCompletionRequest.model_json_schema()["$defs"]
    assert defs["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert defs["ResponseFormat"]["additionalProperties"] is False


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


def test_response_schemas_require_what_is_always_sent():
    chunk = ChatCompletionChunk.model_json_schema(mode="serialization")
    assert set(chunk["required"]) == {"id", "object", "created", "model", "choices"}   # not usage, speculative
    defs = chunk["$defs"]
    assert defs["ChatDelta"]["required"] == []
    assert set(defs["ChatChunkChoice"]["required"]) == {"index", "delta", "logprobs", "finish_reason"}
    error = ErrorResponse.model_json_schema(mode="serialization")
    assert set(error["$defs"]["ErrorInfo"]["required"]) == {"message", "type", "param", "code"}


def test_completion_response_shape():
    r = CompletionResponse(id="cmpl-1", model="m", choices=[CompletionChoice(index=0, text="t", finish_reason="stop")],
                           usage=UsageInfo(prompt_tokens=1, completion_tokens=2, total_tokens=3))
    d = r.model_dump(mode="json")
    assert d["object"] == "text_completion" and d["usage"]["total_tokens"] == 3 and "speculative" not in d


def test_error_body_shape():
    d = ErrorResponse(error=ErrorInfo(message="m", type="invalid_request_error")).model_dump()
    assert d == {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}

"""OpenAI wire schemas: chat completions, completions, stream chunks, models, errors.

Requests follow OpenAI's strictness: an unknown field is a 400 ("Unrecognized request argument"),
so typos do not pass silently, and types are strict -- ``"8"`` is not an integer, ``"true"`` not a
boolean, ``1.5`` (or ``true``) not an integer; as in JSON Schema, ``8.0`` is an integer and ``8`` a
valid number; NaN and Infinity are refused. Every number is bounded by what the engine can
represent (counts and token ids are int32, seeds int64), and text that UTF-8 cannot encode (a lone
surrogate such as ``"\\ud800"``, which JSON lets through) is refused wherever it appears.
Extensions we accept on top of OpenAI's fields:

* sampling (vLLM names): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``;
* ``speculative``: ``{"drafter": "<name>" | "none", ...}`` per request; extra keys are the drafter's per-request
  options, validated by the engine (an option the drafter does not take per request is a 400).

OpenAI fields we do not implement are accepted only with their neutral value (``suffix`` empty,
``echo`` without ``logprobs``, ...) and rejected with a
400 naming the parameter otherwise; their JSON schema (``WithJsonSchema``) says exactly which
value is accepted, so the OpenAPI document does not advertise what we refuse. Cross-field rules
raise ``PydanticCustomError`` with ``ctx["param"]`` so the server can name the offending parameter
in the error body.

Response models describe what is sent: their JSON schema lists every field as required except
those a model leaves out when None (`ResponseModel._omit_if_none`).
"""

from __future__ import annotations

import json
import re
import time
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, SerializerFunctionWrapHandler,
                      Tag, WithJsonSchema, field_validator, model_serializer, model_validator)
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20       # the same cap as engine.sampling_params.MAX_TOP_LOGPROBS
MAX_INT32 = 2**31 - 1       # the engine packs counts and token ids into int32 (engine.sampling_params.MAX_INT32)
MIN_INT64, MAX_INT64 = -2**63, 2**63 - 1
MAX_N = 128
MAX_LOGIT_BIAS = 300        # engine.sampling_params.MAX_LOGIT_BIAS (OpenAI's limit)
MAX_STOP_SEQUENCES = 16     # the engine's limit
MAX_STOP_LENGTH = 1024      # characters per stop string
MAX_STOP_TOKEN_IDS = 64
_SURROGATE = re.compile("[\ud800-\udfff]")
_NO_TEXT = frozenset({int, float, bool, type(None)})   # the types of JSON values without text


def param_error(param: str | None, message: str) -> PydanticCustomError:
    """A validation error that names the offending request parameter (read back by the server)."""
    return PydanticCustomError("invalid_param", message, {"param": param})


def check_encodable(data: Any) -> None:
    """Raise a `param_error` for the first string in `data` (a value or a key, at any depth) that
    UTF-8 cannot encode. ``json.loads`` turns ``"\\ud800"`` into a lone surrogate, on which the
    tokenizer (or an error body echoing it) would fail. A clean body is checked at C speed (one UTF-8
    encode of its JSON text: a 60,000-string choice in ~10 ms, where the walk takes ~120 ms on the
    event loop); the walk that names the field runs only when that fails. Iterative: deep nesting
    costs no stack."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
        return
    except (UnicodeEncodeError, TypeError, ValueError, RecursionError):
        pass          # a lone surrogate (or a value JSON cannot write, or deep nesting): the walk decides
    stack: list[tuple[Any, tuple[str | int, ...]]] = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            bad = None if value.isascii() else _SURROGATE.search(value)
            if bad is not None:
                param = ".".join(map(str, path))
                raise param_error(param, f"Invalid value for '{param}': the text contains an unpaired surrogate "
                                         f"(U+{ord(bad.group()):04X}), which is not valid Unicode.")
        elif isinstance(value, dict):
            if any(isinstance(key, str) and _SURROGATE.search(key) for key in value):
                param = ".".join(map(str, path)) or None
                where = f"a key of '{param}'" if param else "a field name"
                raise param_error(param, f"Invalid value for {where}: it contains an unpaired surrogate, "
                                         "which is not valid Unicode.")
            stack.extend(reversed([(v, (*path, k)) for k, v in value.items()
                                   if isinstance(v, (str, dict, list))]))
        elif isinstance(value, list) and not _NO_TEXT.issuperset(map(type, value)):   # token ids: skipped at C speed
            stack.extend(reversed([(v, (*path, i)) for i, v in enumerate(value)
                                   if isinstance(v, (str, dict, list))]))


def _whole_number(value: Any) -> Any:
    """``8.0`` -> ``8``: JSON Schema's integer is any number without a fractional part, and
    ``json.loads`` reads ``8.0`` as a float (which strict int validation refuses). Floats beyond
    the int64 range stay floats: no field takes them, and their error message stays short."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**63:
        return int(value)
    return value


def _str_or_list(value: Any) -> str:
    """The member of a ``str | list`` union that validates `value`, so that its errors alone are reported."""
    return "list" if isinstance(value, list) else "str"


# ---- common -----------------------------------------------------------------------------------


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are errors, as in OpenAI's API; types are strict
    (no string-to-number or number-to-bool coercion; an integer is a valid float) and floats finite."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _always_sent(schema: dict[str, Any], cls: type[ResponseModel]) -> None:
    schema["required"] = [name for name in schema.get("properties", {}) if name not in cls._omit_if_none]


class ResponseModel(BaseModel):
    """Base of every response body. Fields named in `_omit_if_none` are left out when None
    (OpenAI omits e.g. ``delta.role`` after the first chunk); all other None fields serialise as null.

    The JSON schema lists every field as required but those in `_omit_if_none`."""

    model_config = ConfigDict(json_schema_extra=_always_sent)

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    # no return annotation: pydantic would take the JSON schema of serialised responses from it
    @model_serializer(mode="wrap")
    def _drop_empty(self, handler: SerializerFunctionWrapHandler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


WholeNumber = BeforeValidator(_whole_number)   # after the constraints, which then reach the JSON schema
Count = Annotated[int, Field(ge=1, le=MAX_INT32), WholeNumber]
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32), WholeNumber]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
Stop = Annotated[Union[Annotated[StopString, Tag("str")],
                       Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES), Tag("list")]],
                 Discriminator(_str_or_list)]


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None   # OpenAI's; nothing to obfuscate here, accepted and ignored


class SpeculativeOptions(BaseModel):
    """The per-request ``speculative`` extension. Keys beyond ``drafter`` are the drafter's
    per-request options: kept as given here, validated by the engine against what the drafter
    declares (an undeclared one is a 400 naming ``speculative.<key>``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    drafter: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _whole_number_options(cls, data: Any) -> Any:
        """``"max_depth": 4.0`` -> ``4``, as the top-level integer fields take it (`WholeNumber`); the
        drafter then checks the option (``4.5`` is refused, naming ``speculative.max_depth``)."""
        if isinstance(data, dict):
            return {key: value if key == "drafter" else _whole_number(value) for key, value in data.items()}
        return data

    @property
    def wants_drafter(self) -> bool:
        return self.drafter not in (None, "", "none")


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""

    json_: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise param_error("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, "
                                                    f"grammar, json_object; got {len(given)}")
        return self


def _json_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


class EncodableText(RequestModel):
    """A request body whose text is refused where UTF-8 cannot encode it (`check_encodable`)."""

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_encodable(data)
        return data


class SamplingFields(EncodableText):
    """Fields shared by chat and completions requests."""

    model: str | None = None          # None: the served model
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), WholeNumber] | None = 1
    stop: Stop | None = None
    seed: Annotated[int, Field(ge=MIN_INT64, le=MAX_INT64), WholeNumber] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = 0.0
    # token id (as a string, OpenAI's form) -> bias added to its logit
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # extensions
    # -1 or 0: off; above the vocabulary size, every token (the engine clamps it)
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT32), WholeNumber] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT32), WholeNumber] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None
    # structured output (vLLM's names; chat also takes OpenAI's response_format)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    def guided(self) -> tuple[tuple[str, str], str] | None:
        """((kind, text), the parameter it came from) of the request's output constraint, or None."""
        found = []
        so = self.structured_outputs
        if so is not None:
            kind = next(k for k in ("json_", "regex", "choice", "grammar", "json_object")
                        if getattr(so, k) is not None and getattr(so, k) is not False)
            value = {"json_": lambda: _json_text(so.json_), "regex": lambda: so.regex,
                     "choice": lambda: json.dumps(so.choice), "grammar": lambda: so.grammar,
                     "json_object": lambda: '{"type": "object"}'}[kind]()
            found.append(((kind.rstrip("_").replace("json_object", "json"), value), "structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                text = _json_text(value) if kind == "json" else json.dumps(value) if kind == "choice" else value
                found.append(((kind, text), name))
        found += self._response_format_constraint()
        if len(found) > 1:
            raise param_error(found[1][1], "give one output constraint: "
                                           + ", ".join(param for _, param in found) + " were all given")
        return found[0] if found else None

    def _response_format_constraint(self) -> list:
        return []

    @model_validator(mode="after")
    def _one_constraint(self):
        self.guided()
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or ():
            if not re.fullmatch(r"[0-9]{1,10}", key) or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return v

    @property
    def logit_bias_ids(self) -> dict[int, float] | None:
        return {int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None

    @model_validator(mode="after")
    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise param_error("stream_options", "stream_options is only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# ---- chat completions -------------------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


MessageContent = Annotated[Union[Annotated[str, Tag("str")], Annotated[list[TextPart], Tag("list")]],
                           Discriminator(_str_or_list)]


class FunctionDef(RequestModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(RequestModel):
    name: str
    arguments: str


class MessageToolCall(RequestModel):
    """A tool call of an assistant message sent back in the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: MessageContent | None = None
    name: str | None = None
    # fields a client sends back when it replays an assistant message from a response
    refusal: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    annotations: list[Any] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}; only text parts are supported")
        return v

    @model_validator(mode="after")
    def _tool_fields_on_their_roles(self):
        if self.tool_calls and self.role != "assistant":
            raise param_error("messages.tool_calls", "only assistant messages carry tool_calls")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class JsonSchemaFormat(RequestModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise param_error("response_format.json_schema", "response_format type json_schema takes a json_schema "
                                                             "object, and only it does")
        return self


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16,
         "temperature": 0},
        {"messages": [{"role": "system", "content": "Answer in one line."},
                      {"role": "user", "content": [{"type": "text", "text": "Write a haiku about the sea."}]}],
         "max_completion_tokens": 24, "stream": True, "stream_options": {"include_usage": True},
         "logprobs": True, "top_logprobs": 2, "seed": 7, "stop": ["\n\n"], "speculative": {"drafter": "none"}},
    ]})

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WholeNumber] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_tools(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise param_error("tools", "tool function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise param_error("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise param_error("tool_choice", "tool_choice required needs tools")
        return self

    @property
    def tool_mode(self) -> str | None:
        """"auto" (the model chooses, in its own format: server/tool_parsers.py), "required", "named"
        (one named function; both forced through a grammar) or None (no tool call)."""
        if not self.tools or self.tool_choice == "none":
            return None
        if self.tool_choice in (None, "auto"):
            return "auto"
        return "required" if self.tool_choice == "required" else "named"

    def tool_schema(self) -> dict[str, Any] | None:
        """The JSON schema a forced tool call's output follows: the named function's arguments, or
        (required) a list of {"name", "parameters"} objects, one per call (one when parallel calls
        are off)."""
        mode = self.tool_mode
        if mode in (None, "auto"):
            return None
        params = {t.function.name: t.function.parameters or {"type": "object"} for t in self.tools}
        if mode == "named":      # (an unknown name is the tool validator's 400)
            return params.get(self.tool_choice.function.name)
        call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                           "required": ["name", "parameters"], "additionalProperties": False}
                          for n, p in params.items()]}
        schema = {"type": "array", "items": call, "minItems": 1}
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return schema

    def _response_format_constraint(self) -> list:
        rf = self.response_format
        tools = self.tool_schema()
        if tools is not None:
            return [(("json", json.dumps(tools)), "tool_choice")] + ([] if rf is None or rf.type == "text" else
                                                                     [(("json", "{}"), "response_format")])
        if rf is None or rf.type == "text":
            return []
        schema = rf.json_schema.schema_ if rf.type == "json_schema" else None
        return [(("json", json.dumps(schema if schema is not None else {"type": "object"})), "response_format")]

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise param_error("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens wins over the deprecated max_tokens, as in OpenAI's API."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's `logprobs`: None (off) or the number of alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- completions ------------------------------------------------------------------------------


def _prompt_form(value: Any) -> str:
    """The member of the `Prompt` union that validates `value` (a token-id list unless it holds text or lists)."""
    if not isinstance(value, list):
        return "str"
    if value and isinstance(value[0], str):
        return "list[str]"
    if value and isinstance(value[0], list):
        return "list[list[int]]"
    return "list[int]"


Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# one prompt: text, token ids, or a batch of exactly one of either (the engine checks ids against the vocabulary)
Prompt = Annotated[Union[Annotated[Text, Tag("str")],
                         Annotated[TokenIds, Tag("list[int]")],
                         Annotated[list[Text], Field(min_length=1, max_length=1), Tag("list[str]")],
                         Annotated[list[TokenIds], Field(min_length=1, max_length=1), Tag("list[list[int]]")]],
                   Discriminator(_prompt_form)]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": [1, 2, 3], "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
         "logprobs": 2, "top_k": 40, "seed": 7, "stop": "\n"},
    ]})

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), WholeNumber] | None = None
    echo: bool | None = False
    best_of: Annotated[int, Field(ge=1, le=MAX_N), WholeNumber] | None = None
    suffix: Annotated[str, WithJsonSchema({"type": "string", "maxLength": 0})] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 1 and isinstance(v[0], (str, list)):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        if v in ("", [], [""], [[]]):
            raise ValueError("the prompt is empty")
        return v

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise param_error("echo", "echo with logprobs is not supported (the prompt's logprobs are not computed)")
        return self

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported by this server")
        return v

    @model_validator(mode="after")
    def _check_best_of(self):
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise param_error("best_of", "best_of is not supported; leave it unset or equal to n")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


# ---- responses --------------------------------------------------------------------------------


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SpeculativePartUsage(ResponseModel):
    """One part of a composite drafter (e.g. a sub-drafter of a cascade): the draft tokens it
    proposed for this request and how many of them were accepted."""

    name: str
    draft_tokens: int = 0
    accepted_tokens: int = 0


class SpeculativeUsage(ResponseModel):
    """The ``speculative`` block of a response (filled once drafters are served). ``parts`` is
    there only for a drafter whose trees say which of its parts proposed each node; its counts
    sum to ``draft_tokens`` / ``accepted_tokens``."""

    _omit_if_none = frozenset({"parts"})

    drafter: str
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    mean_accepted_length: float = 0.0
    parts: list[SpeculativePartUsage] | None = None


class SpeculativeDecodingMetrics(ResponseModel):
    """vLLM's per-request speculation figures (`metrics.speculative_decoding`, what AIPerf reads),
    zeros for plain decoding: verification steps with a draft, draft tokens proposed, draft tokens
    accepted (the bonus token excluded), their ratio (0 without drafts), the mean acceptance length
    1 + accepted / steps (the bonus included, vLLM's convention; 1 without steps), and
    `acceptance_histogram[k]` the steps that accepted k draft tokens."""

    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    draft_acceptance_rate: float = 0.0
    mean_acceptance_length: float = 1.0
    acceptance_histogram: list[int] = Field(default_factory=list)


class ResponseMetrics(ResponseModel):
    speculative_decoding: SpeculativeDecodingMetrics


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class ToolCallFunction(ResponseModel):
    name: str
    arguments: str


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatResponseMessage(ResponseModel):
    _omit_if_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None       # vLLM's extension: the stop string / token that ended it


class ChatCompletionResponse(ResponseModel):
    _omit_if_none = frozenset({"speculative", "metrics"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    speculative: SpeculativeUsage | None = None
    metrics: ResponseMetrics | None = None


class DeltaToolCall(ResponseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatDelta(ResponseModel):
    _omit_if_none = frozenset({"role", "content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ResponseModel):
    _omit_if_none = frozenset({"stop_reason"})

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(ResponseModel):
    _omit_if_none = frozenset({"usage", "speculative", "metrics"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    speculative: SpeculativeUsage | None = None
    metrics: ResponseMetrics | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(ResponseModel):
    _omit_if_none = frozenset({"usage", "speculative", "metrics"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    speculative: SpeculativeUsage | None = None
    metrics: ResponseMetrics | None = None


class CompletionChunk(CompletionResponse):
    """OpenAI streams completions as ``text_completion`` objects carrying text deltas."""

    created: int


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int | None = None    # vLLM's extension


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class HealthStatus(ResponseModel):
    """The body of a healthy ``GET /health``."""

    status: Literal["ok"] = "ok"


# ---- errors -----------------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- vLLM's utility endpoints (server/token_routes.py) -------------------------------------------


class TokenizeRequest(EncodableText):
    """vLLM's `POST /tokenize`: a `prompt` (special tokens added by default) or chat `messages`
    through the chat template (with the generation prompt by default; special tokens not added
    again by default, as the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise param_error("prompt", "send either prompt or messages")
        return self


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionInfo(ResponseModel):
    """The body of ``GET /version``."""

    version: str


"""OpenAI wire schemas: chat completions, completions, stream chunks, models, errors.

Requests follow OpenAI's strictness: an unknown field is a 400 ("Unrecognized request argument"),
so typos do not pass silently. Extensions we accept on top of OpenAI's fields:

* sampling (vLLM names): ``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
  ``include_stop_str_in_output``, ``skip_special_tokens``;
* ``speculative``: ``{"drafter": "<name>" | "none", ...}`` per request; extra keys are kept and handed on.

OpenAI fields we do not implement are accepted only with their neutral value (penalties 0, empty
``logit_bias``, no ``tools``, ``response_format`` text, ``echo`` false, ...) and rejected with a
400 naming the parameter otherwise. Cross-field rules raise ``PydanticCustomError`` with
``ctx["param"]`` so the server can name the offending parameter in the error body.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, field_validator,
                      model_serializer, model_validator)
from pydantic_core import PydanticCustomError

MAX_TOP_LOGPROBS = 20  # the same cap as engine.sampling_params.MAX_TOP_LOGPROBS


def param_error(param: str, message: str) -> PydanticCustomError:
    """A validation error that names the offending request parameter (read back by the server)."""
    return PydanticCustomError("invalid_param", message, {"param": param})


# ---- common -----------------------------------------------------------------------------------


class RequestModel(BaseModel):
    """Base of every request body: unknown fields are errors, as in OpenAI's API."""

    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    """Base of every response body. Fields named in `_omit_if_none` are left out when None
    (OpenAI omits e.g. ``delta.role`` after the first chunk); all other None fields serialise as null."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_empty(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None   # OpenAI's; nothing to obfuscate here, accepted and ignored


class SpeculativeOptions(BaseModel):
    """The per-request ``speculative`` extension. Keys beyond ``drafter`` are drafter options, kept as given."""

    model_config = ConfigDict(extra="allow")

    drafter: str | None = None

    @property
    def wants_drafter(self) -> bool:
        return self.drafter not in (None, "", "none")


class SamplingFields(RequestModel):
    """Fields shared by chat and completions requests."""

    model: str | None = None          # None: the served model
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # extensions
    top_k: int | None = None          # <= 0: off
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _only_zero_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0):
            raise ValueError("penalties are not supported by this server; only 0 is accepted")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return v

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


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # fields a client sends back when it replays an assistant message from a response; must be empty
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
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

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tool calls are not supported by this server")
        return v

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if v not in (None, "none", "auto"):
            raise ValueError("tool calling is not supported by this server")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_format_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError("only response_format {'type': 'text'} is supported")
        return v

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


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

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


class SpeculativeUsage(ResponseModel):
    """The ``speculative`` block of a response (filled once drafters are served)."""

    drafter: str
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    mean_accepted_length: float = 0.0


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


class ChatResponseMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None       # vLLM's extension: the stop string / token that ended it


class ChatCompletionResponse(ResponseModel):
    _omit_if_none = frozenset({"speculative"})

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    speculative: SpeculativeUsage | None = None


class ChatDelta(ResponseModel):
    _omit_if_none = frozenset({"role", "content"})

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(ResponseModel):
    _omit_if_none = frozenset({"stop_reason"})

    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(ResponseModel):
    _omit_if_none = frozenset({"usage", "speculative"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    speculative: SpeculativeUsage | None = None


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(ResponseModel):
    _omit_if_none = frozenset({"usage", "speculative"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    speculative: SpeculativeUsage | None = None


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


# ---- errors -----------------------------------------------------------------------------------


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo

"""The OpenAI endpoints: /v1/chat/completions, /v1/completions, /v1/models, plus /health.

Each completion request: validate (pydantic) -> check model and drafter -> build the prompt token
ids -> `SamplingParams` -> `engine.add_request` -> stream `RequestOutput` deltas back as one JSON
body or as SSE chunks. Errors leave as `OpenAIError` and become OpenAI's error body in `app.py`.

A request whose client disconnects is aborted in the engine (its KV blocks return to the pool):
a watcher task waits for the ASGI ``http.disconnect`` message while the request runs, for streamed
and non-streamed requests alike; closing the SSE generator (Starlette cancels it on disconnect)
aborts it as well.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.engine.errors import (EngineDeadError, EngineError, InvalidRequestError, QueueFullError,
                                     RequestFailedError, ShuttingDownError)
from specserve.engine.outputs import RequestOutput, TokenLogprob
from specserve.engine.sampling_params import SamplingParams
from specserve.server.metrics import RequestTracker, ServerMetrics
from specserve.server.prompt_guard import LaneFull, PromptBound, TokenizerLanes, text_bytes
from specserve.server.tool_parsers import tool_call_parser
from specserve.server.protocol import (ChatChoiceLogprobs, ChatChunkChoice, ChatCompletionChoice,
                                       ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
                                       ChatMessage, ChatResponseMessage, ChatTokenLogprob, CompletionChoice, DeltaToolCall,
                                       CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       ErrorInfo, ErrorResponse, ModelCard, ModelList, ResponseMetrics, SamplingFields,
                                       SpeculativeDecodingMetrics, SpeculativeOptions, SpeculativePartUsage,
                                       SpeculativeUsage, ToolCall, ToolCallFunction, TopLogprob, UsageInfo)

logger = logging.getLogger("specserve.server")

MIN_LOGPROB = -9999.0          # stands in for -inf, which JSON cannot carry (vLLM does the same)
DEFAULT_MODEL_ALIAS = "default"  # always names the served model, whatever its name
T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_ECHO_CHARS = 256             # a client's string echoed in an error message is cut to this many characters
LONG_MESSAGE_CHARS = 1024        # an error message longer than this has its long quoted runs / words clipped
# the `code` of an error raised without one, by status: every error body carries a code
DEFAULT_ERROR_CODES = {400: "invalid_request", 401: "invalid_api_key", 403: "forbidden", 404: "not_found",
                       405: "method_not_allowed", 408: "request_timeout", 409: "conflict",
                       413: "request_too_large", 415: "unsupported_media_type", 422: "invalid_request",
                       429: "rate_limit_exceeded", 499: "client_closed_request", 500: "internal_error",
                       501: "not_implemented", 503: "service_unavailable"}
_LONG_RUN = re.compile(r"'[^'\n]{%d,}'|\"[^\"\n]{%d,}\"|`[^`\n]{%d,}`|\S{%d,}" % ((MAX_ECHO_CHARS + 3,) * 4))


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` cut to `limit` characters plus a marker saying how much was cut, when longer: how a
    client-supplied string (a model name, a drafter or option name, a path) is echoed in an error."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text) - limit} more characters]"


def clip_message(message: str) -> str:
    """A long error message with each over-long quoted run or word clipped (`clip`): the net under
    the places that clip what they echo, for messages built elsewhere (the engine, the drafters)."""
    if len(message) <= LONG_MESSAGE_CHARS:
        return message

    def clipped(match: re.Match) -> str:
        run = match.group()
        if run[0] in "'\"`" and run[-1] == run[0]:
            return run[0] + clip(run[1:-1]) + run[-1]
        return clip(run)

    return _LONG_RUN.sub(clipped, message)


class OpenAIError(Exception):
    """An error answered with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        if code is None:
            code = DEFAULT_ERROR_CODES.get(status_code, "invalid_request" if status_code < 500 else "internal_error")
        self.info = ErrorInfo(message=clip_message(message), type=type,
                              param=None if param is None else clip(param), code=code)
        self.headers = dict(headers or {})   # sent with the error (e.g. Retry-After on a 429)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(mode="json"), status_code=self.status_code,
                            headers={**self.headers, **(headers or {})} or None)


def engine_error(exc: EngineError, prompt_param: str | None = None) -> OpenAIError:
    """Map an engine error to its HTTP status: 400 invalid, 429 queue full, 503 engine dead."""
    if isinstance(exc, InvalidRequestError):
        param = exc.param
        if param in ("messages", "prompt") and prompt_param is not None:
            param = prompt_param
        code = getattr(exc, "code", None)
        if code is None:
            if "context length" in str(exc):
                code = "context_length_exceeded"
            elif param == "speculative.drafter":
                code = "drafter_not_loaded"
            else:
                code = "invalid_value" if param else "invalid_request"
        return OpenAIError(400, str(exc), param=param, code=code)
    if isinstance(exc, QueueFullError):
        retry = {"Retry-After": str(max(1, int(exc.retry_after)))} if exc.retry_after is not None else None
        return OpenAIError(429, str(exc), type="rate_limit_error", code="queue_full", headers=retry)
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, ShuttingDownError):
        return OpenAIError(503, str(exc), type="service_unavailable_error", code="shutting_down")
    if isinstance(exc, RequestFailedError):
        if exc.code == "constraint_failed":   # the client's constraint ran into a limit of the grammar engine
            return OpenAIError(400, str(exc), code="constraint_failed")
        return OpenAIError(500, str(exc), type="server_error", code="request_failed")
    return OpenAIError(500, f"engine error: {exc}", type="server_error", code="internal_error")


# ---- token strings for logprobs ---------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte <-> printable-character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class TokenRenderer:
    """Token id -> (string, UTF-8 bytes) as OpenAI's logprobs show them; cached per id.

    Byte-level BPE pieces map back to their exact bytes (a piece may hold half a UTF-8 character:
    its string then carries U+FFFD, its bytes are exact); SentencePiece pieces turn ``▁`` into a
    space and ``<0xNN>`` into that byte; special tokens show as written.
    """

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        decoder = str(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", "") or "")
        self._byte_decoder = {c: b for b, c in _bytes_to_unicode().items()} if "ByteLevel" in decoder else None
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])

    def render(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._render(token_id)
        return hit

    def _render(self, token_id: int) -> tuple[str, bytes]:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", b""
        if token_id in self._special:
            return piece, piece.encode()
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            raw = bytes(self._byte_decoder[c] for c in piece)
            return raw.decode("utf-8", errors="replace"), raw
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                raw = bytes([int(piece[3:5], 16)])
                return raw.decode("utf-8", errors="replace"), raw
            except ValueError:
                pass
        if "▁" in piece:
            text = piece.replace("▁", " ")
        else:
            text = self._tok.decode([token_id], skip_special_tokens=False)
        return text, text.encode()

    def chat_logprobs(self, logprobs: list[TokenLogprob]) -> ChatChoiceLogprobs:
        content = []
        for lp in logprobs:
            text, raw = self.render(lp.token_id)
            top = []
            for tid, value in lp.top:
                t, b = self.render(tid)
                top.append(TopLogprob(token=t, logprob=max(value, MIN_LOGPROB), bytes=list(b)))
            content.append(ChatTokenLogprob(token=text, logprob=max(lp.logprob, MIN_LOGPROB), bytes=list(raw),
                                            top_logprobs=top))
        return ChatChoiceLogprobs(content=content)

    def completion_logprobs(self, logprobs: list[TokenLogprob], text_offset: int) -> tuple[CompletionLogprobs, int]:
        """OpenAI's legacy shape; `text_offset` is where this delta starts in the choice's text.
        Returns the logprobs and the offset after them."""
        out = CompletionLogprobs()
        for lp in logprobs:
            text, _ = self.render(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(max(lp.logprob, MIN_LOGPROB))
            top: dict[str, float] = {}
            for tid, value in lp.top:
                top.setdefault(self.render(tid)[0], max(value, MIN_LOGPROB))
            out.top_logprobs.append(top)
            out.text_offset.append(text_offset)
            text_offset += len(text)
        return out, text_offset


# ---- server state -----------------------------------------------------------------------------


@dataclass
class ServerState:
    """What the routes need, kept on ``app.state.specserve``."""

    engine: object                       # AsyncEngine (duck-typed so tests may stand in a fake)
    model_name: str                      # the served model name, echoed in every response
    metrics: ServerMetrics
    api_key: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    renderer: TokenRenderer | None = None
    draining: bool = False               # shutting down: readiness fails, new requests get 503
    lanes: TokenizerLanes = field(default_factory=TokenizerLanes)
    bound: PromptBound | None = None     # the least tokens a prompt text can become (server/prompt_guard.py)
    tool_call_parser: str = "auto"       # server/tool_parsers.py: for tool_choice auto
    tool_parser: object = None
    tool_parser_problem: str | None = None

    def __post_init__(self) -> None:
        if self.renderer is None:
            self.renderer = TokenRenderer(self.engine.tokenizer)
        if self.tool_parser is None:
            self.tool_parser, self.tool_parser_problem = tool_call_parser(self.engine.tokenizer, self.tool_call_parser)
        if self.bound is None:
            try:
                self.bound = PromptBound(self.engine.tokenizer, lambda i: self.renderer.render(i)[1])
            except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to read: no bound
                logger.warning("no prompt-size bound for this tokenizer; long prompts are tokenized to be measured")

    async def off_loop(self, fn: Callable[..., T], *args, size: int = 0) -> T:
        """`fn(*args)` on the tokenizer threads of the lane for a prompt of `size` bytes of text:
        templating and tokenizing a long prompt take seconds (the tokenizer releases the GIL), during
        which /health, every stream and every small prompt must keep going. A full large lane is a
        429 `tokenizer_busy`."""
        try:
            return await self.lanes.run(size, fn, *args)
        except LaneFull as exc:
            raise OpenAIError(429, f"The server is busy tokenizing other large prompts ({exc}); retry later.",
                              type="rate_limit_error", code="tokenizer_busy", headers={"Retry-After": "1"}) from exc

    def check_prompt_size(self, size: int, param: str) -> None:
        """400 `context_length_exceeded` when a prompt of `size` bytes of text cannot fit the context
        whatever its tokens: without templating or tokenizing it."""
        max_model_len = self.engine.max_model_len
        least = self.bound.min_tokens(size) if self.bound is not None else 0
        if least >= max_model_len:
            raise OpenAIError(
                400, f"This model's maximum context length is {max_model_len} tokens. However, the {size} bytes "
                     f"of text in the {param} make at least {least} tokens (no token covers more than "
                     f"{self.bound.max_token_bytes} bytes). Please reduce the length of the {param}.",
                param=param, code="context_length_exceeded")

    @property
    def model_aliases(self) -> set[str]:
        return {self.model_name, self.engine.model_name, DEFAULT_MODEL_ALIAS}


def get_state(request: Request) -> ServerState:
    return request.app.state.specserve


async def check_api_key(request: Request) -> None:
    """Bearer-token check for /v1/*, when the server has an API key."""
    key = get_state(request).api_key
    if not key:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise OpenAIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                          code="invalid_api_key")


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])


# ---- request -> engine ------------------------------------------------------------------------


def _check_accepting(state: ServerState) -> None:
    if state.draining:
        raise OpenAIError(503, "The server is shutting down and accepts no new requests; retry on another replica.",
                          type="service_unavailable_error", code="shutting_down")


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_aliases:
        raise OpenAIError(404, f"The model `{clip(model)}` does not exist. This server serves `{state.model_name}`.",
                          param="model", code="model_not_found")


def _drafter_args(spec: SpeculativeOptions | None) -> dict:
    """The `speculative` extension as `add_request` keyword arguments, as the client sent it: {}
    (the server's default drafter), {"drafter": name} ("none" = plain decoding), plus
    `drafter_options` for the keys besides `drafter`. The engine validates them (a drafter not
    loaded, an option it does not take per request: a 400 naming `speculative.<key>`)."""
    if spec is None:
        return {}
    options = dict(spec.model_extra or {})
    args: dict = {"drafter": spec.drafter} if spec.drafter else {}
    if options:
        args["drafter_options"] = options
    return args


def _response_metrics(out: RequestOutput | None) -> ResponseMetrics:
    """The response's `metrics` block: vLLM's per-request speculation figures (zeros for plain decoding)."""
    spec = getattr(out, "spec", None)
    if spec is None:
        return ResponseMetrics(speculative_decoding=SpeculativeDecodingMetrics())
    steps, drafted, accepted = spec.num_spec_steps, spec.num_draft_tokens, spec.num_accepted_tokens
    return ResponseMetrics(speculative_decoding=SpeculativeDecodingMetrics(
        num_spec_steps=steps, num_draft_tokens=drafted, num_accepted_draft_tokens=accepted,
        draft_acceptance_rate=round(accepted / drafted, 6) if drafted else 0.0,
        mean_acceptance_length=round(1 + accepted / steps, 6) if steps else 1.0,
        acceptance_histogram=list(spec.accepted_length_counts)))


def _spec_usage(out: RequestOutput | None) -> SpeculativeUsage | None:
    """The response's `speculative` block, when the request was decoded with a drafter."""
    spec = getattr(out, "spec", None)
    if spec is None or not spec.drafter:
        return None
    parts = [SpeculativePartUsage(name=name, draft_tokens=p.num_draft_tokens, accepted_tokens=p.num_accepted_tokens)
             for name, p in getattr(spec, "parts", {}).items()] or None
    return SpeculativeUsage(drafter=spec.drafter, draft_tokens=spec.num_draft_tokens,
                            accepted_tokens=spec.num_accepted_tokens, target_forwards=spec.num_target_forwards,
                            mean_accepted_length=round(spec.mean_accepted_length, 4), parts=parts)


def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], tools: list[dict] | None = None, *,
                    add_generation_prompt: bool = True, add_special_tokens: bool = False) -> list[int]:
    """The conversation through the model's chat template (with `tools` where the template renders them)."""
    tokenizer = state.engine.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(400, "this model has no chat template; send a plain prompt (/v1/completions, or "
                               "/tokenize's `prompt`)", param="messages", code="chat_template_missing")
    conversation = [m.template_dict() for m in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, add_generation_prompt=add_generation_prompt,
                                             tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation (e.g. role order) is a 400
        raise OpenAIError(400, f"the chat template rejected the messages: {exc}", param="messages",
                          code="invalid_value") from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _completion_prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        return state.engine.tokenizer.encode(prompt, add_special_tokens=True)
    return list(prompt)


def vocab_size(engine) -> int | None:
    """The target's vocabulary size (the token ids it can produce), when the engine tells it."""
    size = getattr(engine, "vocab_size", None)
    if size is None:
        size = getattr(getattr(getattr(engine, "engine", None), "model_config", None), "vocab_size", None)
    return size if isinstance(size, int) else None


def _check_stop_token_ids(state: ServerState, ids: list[int] | None) -> None:
    vocab = vocab_size(state.engine)
    for i, token in enumerate(ids or ()):
        if vocab is not None and not 0 <= token < vocab:
            raise OpenAIError(400, f"Invalid value for 'stop_token_ids.{i}': token id {token} is outside this "
                                   f"model's vocabulary [0, {vocab}).", param=f"stop_token_ids.{i}",
                              code="invalid_value")


async def _compile_constraint(state: ServerState, body: SamplingFields, params: SamplingParams):
    """The request's output constraint compiled off the event loop: the matcher the request carries
    to the engine (so neither the event loop nor the engine thread compiles it again, even if the
    grammar cache dropped it meanwhile); None without a constraint. A constraint that does not
    compile is a 400 naming the field it came from."""
    grammars = getattr(getattr(state.engine, "engine", None), "grammars", None)
    if params.guided is None or grammars is None:
        return None
    hit = grammars.cached(params.guided)
    if hit is not None:
        return hit
    try:
        return await asyncio.wrap_future(grammars.submit(params.guided))
    except InvalidRequestError as exc:
        raise OpenAIError(400, str(exc), param=body.guided()[1], code="invalid_value") from exc
    except QueueFullError as exc:
        raise engine_error(exc) from exc


def _sampling_params(state: ServerState, body: SamplingFields, num_prompt_tokens: int, max_tokens: int | None,
                     logprobs: int | None, prompt_param: str) -> SamplingParams:
    _check_stop_token_ids(state, body.stop_token_ids)
    max_model_len = state.engine.max_model_len
    room = max_model_len - num_prompt_tokens
    if num_prompt_tokens and (room < 1 or (max_tokens is not None and max_tokens > room)):
        asked = max_tokens if max_tokens is not None else 1
        raise OpenAIError(
            400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                 f"{num_prompt_tokens + asked} tokens ({num_prompt_tokens} in the {prompt_param}, {asked} in the "
                 f"completion). Please reduce the length of the {prompt_param} or of max_tokens.",
            param=prompt_param, code="context_length_exceeded")
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            max_tokens=max_tokens if max_tokens is not None else max(room, 1),
            min_tokens=body.min_tokens,
            stop=body.stop_list,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            seed=body.seed,
            n=body.n or 1,
            logprobs=logprobs,
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=body.logit_bias_ids,
            min_p=body.min_p or 0.0,
            guided=guided[0] if (guided := body.guided()) else None,
        )
    except InvalidRequestError as exc:
        raise engine_error(exc, prompt_param) from exc


class EngineCall:
    """One request in the engine, seen from the edge: iterate it for `RequestOutput`s (metrics are
    observed on the way), `watch()` aborts it when the client disconnects, `close()` always runs."""

    def __init__(self, state: ServerState, raw: Request, request_id: str, prompt_ids: list[int],
                 params: SamplingParams, prompt_param: str, drafter_args: dict, grammar=None):
        self.state = state
        self.raw = raw
        self.request_id = request_id
        self.disconnected = False
        self._watcher: asyncio.Task | None = None
        try:
            self.stream = state.engine.add_request(request_id, prompt_ids, params, grammar=grammar, **drafter_args)
        except EngineError as exc:
            raise engine_error(exc, prompt_param) from exc
        raw.state.specserve_tracked = True          # from here on the tracker counts this request's outcome
        self.tracker: RequestTracker = state.metrics.track(drafter_args.get("drafter"))

    def watch(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(self._watch_disconnect())

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.raw.receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                logger.info("client of %s disconnected; aborting it", self.request_id)
                self.state.engine.abort(self.request_id)   # the stream then ends with finish_reason "abort"
                return

    def __aiter__(self) -> "EngineCall":
        return self

    async def __anext__(self) -> RequestOutput:
        out = await self.stream.__anext__()
        self.tracker.observe(out)
        return out

    def failed(self) -> None:
        self.tracker.finish("error")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        await self.stream.aclose()
        self.tracker.finish()


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _sse_error(exc: EngineError) -> str:
    return _sse(ErrorResponse(error=engine_error(exc).info).model_dump_json())


def _usage(out: RequestOutput | None) -> UsageInfo:
    if out is None:
        return UsageInfo()
    return UsageInfo(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_generated_tokens,
                     total_tokens=out.num_prompt_tokens + out.num_generated_tokens)


def _streaming_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers=SSE_HEADERS)


# ---- chat completions -------------------------------------------------------------------------


@v1.post("/chat/completions")
async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
    state = get_state(raw)
    _check_accepting(state)
    check_model(state, body.model)
    drafter_args = _drafter_args(body.speculative)
    size = text_bytes(m.text for m in body.messages)
    state.check_prompt_size(size, "messages")
    if body.tool_mode == "auto" and state.tool_parser is None:
        raise OpenAIError(400, f"tool_choice auto (the default with tools) needs the model's own tool-call format, "
                               f"and {state.tool_parser_problem}; send tool_choice 'required' or a named function "
                               f"(forced through a grammar), or 'none'", param="tool_choice", code="invalid_value")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tool_mode else None
    prompt_ids = await state.off_loop(chat_prompt_ids, state, body.messages, tools, size=size)
    params = _sampling_params(state, body, len(prompt_ids), body.requested_max_tokens, body.num_logprobs,
                              "messages")
    grammar = await _compile_constraint(state, body, params)
    call = EngineCall(state, raw, _new_id("chatcmpl"), prompt_ids, params, "messages", drafter_args, grammar)
    if body.stream:
        return _streaming_response(_chat_stream(state, body, call, params.n))
    return await _chat_full(state, body, call, params.n)


@dataclass
class _Collected:
    """A whole non-streamed request: per choice its text, logprobs and how it ended."""

    texts: list[str]
    logprobs: list[list[TokenLogprob]]
    finish_reasons: list[str | None]
    stop_reasons: list[str | int | None]
    final: RequestOutput | None


async def _collect(call: EngineCall, n: int) -> _Collected | None:
    """Run `call` to its end; None when the client went away meanwhile."""
    texts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    stop_reasons: list[str | int | None] = [None] * n
    final = None
    call.watch()
    try:
        async for out in call:
            for d in out.outputs:
                texts[d.index].append(d.text)
                if d.logprobs:
                    logprobs[d.index].extend(d.logprobs)
                if d.finish_reason:
                    finish[d.index], stop_reasons[d.index] = d.finish_reason, d.stop_reason
            final = out
    except EngineError as exc:
        call.failed()
        raise engine_error(exc) from exc
    finally:
        await call.close()
    if call.disconnected:
        return None
    return _Collected(["".join(t) for t in texts], logprobs, finish, stop_reasons, final)


def _tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=ToolCallFunction(name=name, arguments=arguments))


def _answer(state: ServerState, body: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall] | None]:
    """(content, tool calls) of a whole answer. Forced calls (a constrained answer): named, the text
    is the function's arguments; required, a list of {"name", "parameters"} objects; text cut by
    max_tokens is the calls as far as they got (`_cut_calls`), as OpenAI answers a call cut by
    max_tokens: its arguments incomplete, finish_reason "length". Auto: the server's parser reads the
    model's own format (server/tool_parsers.py)."""
    if body.tool_mode == "auto":   # parallel_tool_calls false: the model's first call only
        content, calls = state.tool_parser.parse(text)
        return content, [_tool_call(name, args) for name, args in calls[:1 if body.parallel_tool_calls is False
                                                                         else None]] or None
    if not body.tool_mode:
        return text, None
    try:
        value = json.loads(text)
    except ValueError:
        return None, [_tool_call(name, args) for name, args in _cut_calls(body, text)] or None
    calls = [(body.tool_choice.function.name, value)] if body.tool_mode == "named" else \
        [(c["name"], c["parameters"]) for c in value]
    return None, [_tool_call(name, json.dumps(args)) for name, args in calls]


_CALL_NAME = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")(\s*,\s*"parameters"\s*:\s*)?')


def _cut_calls(body: ChatCompletionRequest, text: str) -> list[tuple[str, str]]:
    """(name, arguments text) of forced calls whose text max_tokens cut: named, the one call with
    the arguments written so far; required, each call of the list whose name was written, the last
    with its arguments as far as they got (none yet: ""; the grammar writes the calls as compact JSON)."""
    if body.tool_mode == "named":
        return [(body.tool_choice.function.name, text)]
    calls, decoder = [], json.JSONDecoder()
    for match in _CALL_NAME.finditer(text):
        start = match.end()
        if match.group(2) is None:      # cut before its arguments began
            calls.append((json.loads(match.group(1)), ""))
            break
        try:
            _, end = decoder.raw_decode(text, start)
        except ValueError:
            calls.append((json.loads(match.group(1)), text[start:]))
            break
        calls.append((json.loads(match.group(1)), text[start:end]))
    return calls


def _tool_finish(body: ChatCompletionRequest, calls: list[ToolCall] | None, reason: str | None) -> str | None:
    """OpenAI's finish reason of an answer with tool calls: tool_calls, but stop for a named function;
    a call cut short keeps its reason (length)."""
    if not calls or reason not in (None, "stop"):
        return reason
    return "stop" if body.tool_mode == "named" else "tool_calls"


async def _chat_full(state: ServerState, body: ChatCompletionRequest, call: EngineCall, n: int) -> Response:
    got = await _collect(call, n)
    if got is None:
        return Response(status_code=499)   # nobody is listening
    answers = [_answer(state, body, got.texts[i]) for i in range(n)]
    calls = [calls for _, calls in answers]
    choices = [
        ChatCompletionChoice(
            index=i, message=ChatResponseMessage(content=answers[i][0], tool_calls=calls[i]),
            logprobs=state.renderer.chat_logprobs(got.logprobs[i]) if body.logprobs else None,
            finish_reason=_tool_finish(body, calls[i], got.finish_reasons[i]), stop_reason=got.stop_reasons[i])
        for i in range(n)]
    response = ChatCompletionResponse(id=call.request_id, model=state.model_name, choices=choices,
                                      usage=_usage(got.final), speculative=_spec_usage(got.final),
                                      metrics=_response_metrics(got.final))
    return JSONResponse(response.model_dump(mode="json"))


def _chat_stream(state: ServerState, body: ChatCompletionRequest, call: EngineCall, n: int) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None,
              speculative: SpeculativeUsage | None = None, metrics: ResponseMetrics | None = None) -> str:
        return _sse(ChatCompletionChunk(id=call.request_id, created=created, model=state.model_name,
                                        choices=choices, usage=usage, speculative=speculative,
                                        metrics=metrics).model_dump_json())

    texts: dict[int, str] = {}
    sent: dict[int, int] = {}       # auto: characters of each choice's text streamed as content
    pending: dict[int, list] = {}   # auto: logprobs of tokens whose text is not streamed yet

    def logprobs(d):
        if not (body.logprobs and body.tool_mode == "auto"):
            return None
        lps = pending.pop(d.index, [])
        return state.renderer.chat_logprobs(lps) if lps else None

    def choice(d) -> ChatChunkChoice:
        if body.tool_mode:
            # forced: the call is sent whole, in the choice's last delta; auto: content streams up to
            # the model's call marker, and the calls come whole in the last delta
            text = texts[d.index] = texts.get(d.index, "") + d.text
            done = sent.get(d.index, 0)
            if d.logprobs:
                pending.setdefault(d.index, []).extend(d.logprobs)
            if not d.finish_reason:
                if body.tool_mode != "auto":
                    return None
                upto = max(done, state.tool_parser.streamable(text))
                if upto == done:
                    return None
                sent[d.index] = upto
                return ChatChunkChoice(index=d.index, delta=ChatDelta(content=text[done:upto]), logprobs=logprobs(d))
            del texts[d.index]
            # what was not streamed yet (auto streams nothing past a call's marker, so the calls are in it)
            content, calls = _answer(state, body, text[done:])
            if done:
                content = content or None
            delta = ChatDelta(content=content, tool_calls=[
                DeltaToolCall(index=k, id=c.id, function=c.function) for k, c in enumerate(calls)] if calls else None)
            return ChatChunkChoice(index=d.index, delta=delta, finish_reason=_tool_finish(body, calls, d.finish_reason),
                                   stop_reason=d.stop_reason, logprobs=logprobs(d))
        return ChatChunkChoice(
            index=d.index, delta=ChatDelta(content=d.text if d.text or not d.finish_reason else None),
            logprobs=state.renderer.chat_logprobs(d.logprobs) if body.logprobs and d.logprobs else None,
            finish_reason=d.finish_reason, stop_reason=d.stop_reason)

    opening = [ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")) for i in range(n)]
    return _stream(call, chunk, choice, body.include_usage, opening)


async def _stream(call: EngineCall, chunk, choice, include_usage: bool, opening=()) -> AsyncIterator[str]:
    """A streamed request's SSE events, chat and completions alike: the `opening` choices, one chunk
    per delta that carries something, the usage chunk when asked for, then [DONE]. An engine error
    becomes an error event before [DONE]; a client that went away ends the stream (and the request)."""
    call.watch()
    final = None
    try:
        for c in opening:
            yield chunk([c])
        async for out in call:
            if call.disconnected:
                return
            for d in out.outputs:
                if d.text or d.finish_reason or d.logprobs:
                    c = choice(d)
                    if c is not None:
                        yield chunk([c])
            final = out
        if include_usage:
            yield chunk([], usage=_usage(final), speculative=_spec_usage(final), metrics=_response_metrics(final))
        yield _sse("[DONE]")
    except EngineError as exc:
        call.failed()
        yield _sse_error(exc)
        yield _sse("[DONE]")
    finally:
        await call.close()


# ---- completions ------------------------------------------------------------------------------


@v1.post("/completions")
async def completions(body: CompletionRequest, raw: Request) -> Response:
    state = get_state(raw)
    _check_accepting(state)
    check_model(state, body.model)
    drafter_args = _drafter_args(body.speculative)
    size = text_bytes([body.single_prompt]) if isinstance(body.single_prompt, str) else 0
    state.check_prompt_size(size, "prompt")
    prompt_ids = await state.off_loop(_completion_prompt_ids, state, body.single_prompt, size=size)
    params = _sampling_params(state, body, len(prompt_ids), body.max_tokens, body.logprobs, "prompt")
    grammar = await _compile_constraint(state, body, params)
    call = EngineCall(state, raw, _new_id("cmpl"), prompt_ids, params, "prompt", drafter_args, grammar)
    echoed = None
    if body.echo:    # the prompt before each choice's text: as sent, or its token ids decoded
        echoed = body.single_prompt if isinstance(body.single_prompt, str) else \
            await state.off_loop(state.engine.tokenizer.decode, prompt_ids, size=4 * len(prompt_ids))
    if body.stream:
        return _streaming_response(_completion_stream(state, body, call, params.n, echoed))
    return await _completion_full(state, body, call, params.n, echoed)


async def _completion_full(state: ServerState, body: CompletionRequest, call: EngineCall, n: int,
                           echoed: str | None = None) -> Response:
    got = await _collect(call, n)
    if got is None:
        return Response(status_code=499)   # nobody is listening
    choices = [
        CompletionChoice(
            index=i, text=(echoed or "") + got.texts[i],
            logprobs=(state.renderer.completion_logprobs(got.logprobs[i], 0)[0] if body.logprobs is not None
                      else None),
            finish_reason=got.finish_reasons[i], stop_reason=got.stop_reasons[i])
        for i in range(n)]
    response = CompletionResponse(id=call.request_id, model=state.model_name, choices=choices,
                                  usage=_usage(got.final), speculative=_spec_usage(got.final),
                                      metrics=_response_metrics(got.final))
    return JSONResponse(response.model_dump(mode="json"))


def _completion_stream(state: ServerState, body: CompletionRequest, call: EngineCall, n: int,
                       echoed: str | None = None) -> AsyncIterator[str]:
    created = int(time.time())
    offsets: dict[int, int] = {}

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None,
              speculative: SpeculativeUsage | None = None, metrics: ResponseMetrics | None = None) -> str:
        return _sse(CompletionChunk(id=call.request_id, created=created, model=state.model_name,
                                    choices=choices, usage=usage, speculative=speculative,
                                    metrics=metrics).model_dump_json())

    def choice(d) -> CompletionChoice:
        logprobs = None
        if body.logprobs is not None:
            logprobs, offsets[d.index] = state.renderer.completion_logprobs(d.logprobs or [], offsets.get(d.index, 0))
        return CompletionChoice(index=d.index, text=d.text, logprobs=logprobs, finish_reason=d.finish_reason,
                                stop_reason=d.stop_reason)

    opening = [CompletionChoice(index=i, text=echoed) for i in range(n)] if echoed else ()
    return _stream(call, chunk, choice, body.include_usage, opening)


# ---- models and health ------------------------------------------------------------------------


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.model_name, created=state.created, max_model_len=state.engine.max_model_len)


@v1.get("/models")
async def list_models(raw: Request) -> JSONResponse:
    return JSONResponse(ModelList(data=[_model_card(get_state(raw))]).model_dump(mode="json"))


@v1.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, raw: Request) -> JSONResponse:
    state = get_state(raw)
    check_model(state, model_id)
    return JSONResponse(_model_card(state).model_dump(mode="json"))


@router.get("/health")
async def health(raw: Request) -> Response:
    """200 while the engine's step loop is alive and the server takes requests; 503 once it is
    shutting down (so a load balancer stops sending at once) or the engine died (for k8s probes)."""
    state = get_state(raw)
    if state.draining:
        return OpenAIError(503, "the server is shutting down", type="service_unavailable_error",
                           code="shutting_down").response()
    if getattr(state.engine, "is_alive", True):
        return JSONResponse({"status": "ok"})
    return OpenAIError(503, "the engine loop is not running", type="service_unavailable_error",
                       code="engine_dead").response()


router.include_router(v1)

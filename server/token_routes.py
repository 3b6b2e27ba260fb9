"""The utility endpoints a vLLM user reaches for, in vLLM's shapes.

    GET /version               {"version": "<specserve's>"}
    GET|POST /ping             /health's answer (vLLM's alias of it)
    POST /tokenize             {"prompt": str} or {"messages": [...]} -> {"count", "max_model_len",
                               "tokens", "token_strs"}; messages go through the chat template as a
                               chat completion's would (tools included)
    POST /detokenize           {"tokens": [...]} -> {"prompt": str}

/tokenize and /detokenize keep /v1's rules: the API key, text that UTF-8 can encode, a prompt that
can fit the context (measured in bytes before it is tokenized) and at most `max_model_len` tokens
to detokenize; their work runs on the tokenizer lanes (`ServerState.off_loop`), like a
completion's prompt. /version and /ping stay open.
"""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from specserve.server.openai_routes import (OpenAIError, chat_prompt_ids, check_api_key, check_model, get_state, health,
                                            vocab_size)
from specserve.server.prompt_guard import text_bytes
from specserve.server.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse,
                                       VersionInfo)

router = APIRouter()
keyed = APIRouter(dependencies=[Depends(check_api_key)])   # /tokenize, /detokenize: /v1's API key rule


def _version() -> str:
    try:
        return importlib.metadata.version("specserve")
    except importlib.metadata.PackageNotFoundError:   # run from a source tree
        return "0+unknown"


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse(VersionInfo(version=_version()).model_dump(mode="json"))


@router.get("/ping")
async def ping(raw: Request) -> Response:
    return await health(raw)


@router.post("/ping")
async def ping_post(raw: Request) -> Response:
    return await health(raw)


def _tokenize(state, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return state.engine.tokenizer.encode(body.prompt, add_special_tokens=add)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    return chat_prompt_ids(state, body.messages, tools, add_generation_prompt=body.add_generation_prompt,
                           add_special_tokens=bool(body.add_special_tokens))


@keyed.post("/tokenize")
async def tokenize(body: TokenizeRequest, raw: Request) -> JSONResponse:
    state = get_state(raw)
    check_model(state, body.model)
    size = text_bytes([body.prompt] if body.prompt is not None else (m.text for m in body.messages))
    state.check_prompt_size(size, "prompt" if body.prompt is not None else "messages")
    tokens = await state.off_loop(_tokenize, state, body, size=size)
    strs = state.engine.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens,
                                         token_strs=strs).model_dump(mode="json"))


@keyed.post("/detokenize")
async def detokenize(body: DetokenizeRequest, raw: Request) -> JSONResponse:
    state = get_state(raw)
    check_model(state, body.model)
    if len(body.tokens) > state.engine.max_model_len:
        raise OpenAIError(400, f"{len(body.tokens)} tokens are more than this model's context of "
                               f"{state.engine.max_model_len}; detokenize them in parts", param="tokens",
                          code="context_length_exceeded")
    vocab = vocab_size(state.engine)
    bad = [t for t in body.tokens if vocab is not None and t >= vocab]
    if bad:
        raise OpenAIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", param="tokens",
                          code="invalid_value")
    text = await state.off_loop(state.engine.tokenizer.decode, body.tokens, size=4 * len(body.tokens))
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))

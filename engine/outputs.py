"""What the engine hands back per step: plain data, streamed as deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.stats import RequestSpecStats


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class SeqDelta:
    """New output of one choice (one sequence of a request) since its previous delta."""

    index: int                      # choice index within the request (0 .. n-1)
    text: str                       # new text, stop strings already cut away
    token_ids: list[int]            # new token ids
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # None while running, else "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestMetrics:
    arrival_time: float              # time.monotonic() at add_request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[SeqDelta]          # only the choices with something new
    finished: bool                   # every choice has finished
    num_prompt_tokens: int
    num_generated_tokens: int        # all choices together, so far
    metrics: RequestMetrics
    prompt_token_ids: list[int] = field(default_factory=list)
    spec: RequestSpecStats | None = None   # speculation figures so far (None when not speculating)
    error: str | None = None               # set when the engine failed this request (its choices end with "error")
    error_code: str = "request_failed"     # "constraint_failed": the request's output constraint failed

"""Per-request sampling settings, validated once at the edge of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_INT32 = 2**31 - 1   # bound of counts and ids the engine packs into tensors
MAX_LOGIT_BIAS = 300    # tokens one request may bias (OpenAI's limit)


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature 0 means greedy (argmax); top_k <= 0 and top_p == 1 disable those filters.
    `logprobs` None returns no log-probabilities; an int k >= 0 returns the chosen token's
    log-probability plus the k most likely alternatives at each step.
    The penalties, `logit_bias` and `min_tokens` act on the logits of each row along its own path
    (engine/logits_processing.py); `min_p` keeps the tokens whose probability after temperature is
    at least min_p times the most likely one's.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_p: float = 0.0
    # structured output: (kind, text), kind one of engine.grammar.GUIDED_KINDS ("json": a JSON schema's
    # text, "regex", "choice": a JSON list of strings, "grammar": Lark or GBNF)
    guided: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.temperature < 0 or self.temperature != self.temperature:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.top_k > MAX_INT32:
            raise InvalidRequestError(f"top_k must be at most {MAX_INT32} (a value at or above the vocabulary size "
                                      f"keeps every token), got {self.top_k}", "top_k")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", "min_tokens")
        if not 1 <= self.n <= 128:
            raise InvalidRequestError(f"n must be in [1, 128], got {self.n}", "n")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not 0 < self.repetition_penalty <= 2.0:
            raise InvalidRequestError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
                                      "repetition_penalty")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
            bias = {}
            for token, value in self.logit_bias.items():
                if not 0 <= int(token) <= MAX_INT32:
                    raise InvalidRequestError(f"logit_bias: {token} is not a token id", "logit_bias")
                if not -100 <= value <= 100:
                    raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value} for "
                                              f"token {token}", "logit_bias")
                bias[int(token)] = float(value)
            self.logit_bias = bias
        if len(self.stop) > 16:
            raise InvalidRequestError("at most 16 stop sequences are supported", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

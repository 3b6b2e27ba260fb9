"""Cheap rejection before tokenization, and tokenizer lanes by size.

Templating and tokenizing cost time and memory in proportion to the prompt's text (a 7.8 MB chat:
~20 s and ~2 GB), so a prompt that cannot fit the context is refused *before* that work, and big
prompts never hold up small ones:

* **A lower bound on the token count.** No token of the vocabulary covers more than
  `max_token_bytes` bytes of text (exact for byte-level BPE, where every token is a byte string;
  UTF-8 length of the piece otherwise, which can only overestimate). So a text of B bytes becomes
  at least ceil(B / max_token_bytes) tokens, whatever the template adds. When that bound alone
  exceeds the context, the request is answered 400 `context_length_exceeded` at once, its text
  never templated nor tokenized (a tokenizer with a normalizer, which may shorten text, gets the
  bound divided by `NORMALIZER_SLACK`).
* **A body limit from the context.** `default_body_limit`: what the longest prompt the context
  holds can take as JSON (four times its longest text, for escapes), at least 1 MiB.
* **Lanes.** Prompts up to `SMALL_PROMPT_BYTES` of text are templated and tokenized on threads of
  their own; bigger ones on others, at most `LARGE_LANE_DEPTH` of them running or waiting (one more
  is refused with 429 `tokenizer_busy` and Retry-After). A chat of a few lines therefore never
  waits behind a megabyte prompt.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")

SMALL_PROMPT_BYTES = 64 * 1024   # prompts up to this many bytes of text take the small lane
SMALL_LANE_THREADS = 2
LARGE_LANE_THREADS = 2
LARGE_LANE_DEPTH = 8             # large prompts running or waiting in their lane; more get 429
NORMALIZER_SLACK = 4             # a normalizer may shorten text: the bound is divided by this
MIN_BODY_LIMIT = 2**20
BODY_LIMIT_FACTOR = 4            # JSON escapes: the body may take this many times the prompt's text


def max_token_bytes(tokenizer, token_bytes: Callable[[int], bytes] | None = None) -> int:
    """The most bytes of text one token of `tokenizer` can stand for (added tokens included).
    `token_bytes(id)`: the exact bytes of a token when known (the logprobs renderer's); otherwise
    the UTF-8 length of its piece, an overestimate for byte-level and SentencePiece vocabularies."""
    if token_bytes is not None:
        return max(1, max(len(token_bytes(i)) for i in range(len(tokenizer))))
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max(1, max(len(p.encode("utf-8", "surrogatepass")) for p in pieces if p))


class PromptBound:
    """The least number of tokens a prompt text of so many bytes can become."""

    def __init__(self, tokenizer, token_bytes: Callable[[int], bytes] | None = None):
        self.max_token_bytes = max_token_bytes(tokenizer, token_bytes)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        normalizer = getattr(backend, "normalizer", None) if backend is not None else True
        # tokenizers' Sequence([]) normalizer is no normalizer at all
        if normalizer is not None and "normalizers=[]" in repr(normalizer):
            normalizer = None
        self.bytes_per_token = self.max_token_bytes * (NORMALIZER_SLACK if normalizer is not None else 1)

    def min_tokens(self, text_bytes: int) -> int:
        return math.ceil(text_bytes / self.bytes_per_token)


def text_bytes(texts) -> int:
    """UTF-8 bytes of the given strings (lone surrogates counted as written)."""
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


def default_body_limit(max_model_len: int, bound: PromptBound) -> int:
    """The request body limit when none is given: room for the longest prompt the context holds,
    as JSON, with its escapes."""
    return max(MIN_BODY_LIMIT, BODY_LIMIT_FACTOR * max_model_len * bound.max_token_bytes + 64 * 1024)


class LaneFull(Exception):
    """The large-prompt lane is full: the request is refused (429) rather than queued."""


class TokenizerLanes:
    """Two thread pools for templating and tokenization, by prompt size (module docstring). Used
    from the server's event loop only, so its count of large prompts needs no lock."""

    def __init__(self, small_threads: int = SMALL_LANE_THREADS, large_threads: int = LARGE_LANE_THREADS,
                 large_depth: int = LARGE_LANE_DEPTH, small_bytes: int = SMALL_PROMPT_BYTES):
        self.small = ThreadPoolExecutor(small_threads, thread_name_prefix="specserve-tokenize")
        self.large = ThreadPoolExecutor(large_threads, thread_name_prefix="specserve-tokenize-large")
        self.large_depth = large_depth
        self.small_bytes = small_bytes
        self._large_in = 0

    async def run(self, size: int, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the lane for a prompt of `size` bytes of text; LaneFull when that is the
        large lane and it holds `large_depth` prompts already."""
        loop = asyncio.get_running_loop()
        if size <= self.small_bytes:
            return await loop.run_in_executor(self.small, fn, *args)
        if self._large_in >= self.large_depth:
            raise LaneFull(f"{self._large_in} large prompts are being tokenized")
        self._large_in += 1
        try:
            return await loop.run_in_executor(self.large, fn, *args)
        finally:
            self._large_in -= 1

    def shutdown(self) -> None:
        for pool in (self.small, self.large):
            pool.shutdown(wait=False, cancel_futures=True)

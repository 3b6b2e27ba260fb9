"""Incremental detokenisation with stop strings, one instance per sequence.

Text is produced from a small window of token ids (vLLM's prefix/read offsets), so each new token
costs O(window), not O(sequence):

    ids:   ... | prefix_offset ......... read_offset ......... len(ids)
                 \\___ prefix_text ___/
                 \\_____________ new_text _____________________/

`prefix_text` is the decoded text of tokens already turned into output; `new_text` adds the new
ones. Decoding a window that starts a few tokens back (rather than at the new tokens) keeps the
tokenizer's context-dependent handling (leading spaces, merges) the same as in a full decode. The
difference `new_text[len(prefix_text):]` becomes output only when `new_text` does not end in
U+FFFD: a byte-level BPE decodes an incomplete multi-byte character as '\\ufffd' until the token
holding its last byte arrives, and a partial character must never reach the client.

When the output ends (EOS, a stop token, max_tokens, the context, an abort) in the middle of a
character, `flush` drops that incomplete character instead of emitting U+FFFD, as OpenAI's API
does: the text a client sees never ends in a character the model did not finish. (A U+FFFD the
model did produce in full, bytes EF BF BD, at the very end is dropped as well: decoded text
cannot tell the two apart.)

Stop strings are searched in the confirmed text. While the sequence runs, the longest suffix of the
text that is a proper prefix of some stop string is held back, so a client never sees the start of
a stop string that completes later.
"""

from __future__ import annotations

from specserve.engine.sampling_params import SamplingParams

# Prompt tokens the first window reaches back (as vLLM), so leading-space handling matches.
INITIAL_PREFIX_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self._backend = backend
        # Only the tail of the prompt is kept: the window never reaches further back.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_PREFIX_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._text = ""          # confirmed generated text (no trailing partial character)
        self._num_emitted = 0    # chars of _text handed out
        self._stopped = False

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:   # the Rust decoder directly: what decode() does, minus overhead
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add_tokens(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Append generated token ids.

        Returns (delta_text, stop_string): delta_text is the new text that is safe to emit now;
        stop_string is the stop string that matched (the text is then cut right before it, or
        right after it with include_stop_str_in_output), else None. After a match, later calls
        are not expected (they return ("", None)).
        """
        if self._stopped or not token_ids:
            return "", None
        self._ids.extend(token_ids)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return "", None    # nothing yet, or a character still incomplete: wait for more tokens
        old_len = len(self._text)
        self._text += new_text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return self._emit(old_len)

    def _emit(self, old_len: int) -> tuple[str, str | None]:
        """Check stop strings in the text added after `old_len`, then hand out what is safe."""
        match = self._find_stop(old_len)
        if match is not None:
            start, stop = match
            self._text = self._text[:start + len(stop) if self.include_stop else start]
            self._stopped = True
            return self._take(len(self._text)), stop
        return self._take(len(self._text) - self._held_back()), None

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The stop string that completes first in the text (earliest end, then earliest start),
        looking only where a match ending in the new text can start."""
        best = None
        for stop in self.stop:
            start = self._text.find(stop, max(old_len - len(stop) + 1, 0))
            if start >= 0:
                key = (start + len(stop), start)
                if best is None or key < best[0]:
                    best = (key, stop)
        if best is None:
            return None
        return best[0][1], best[1]

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        held = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self._text)), held, -1):
                if self._text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def _take(self, end: int) -> str:
        if end <= self._num_emitted:
            return ""
        delta = self._text[self._num_emitted:end]
        self._num_emitted = end
        return delta

    def flush(self) -> str:
        """The sequence finished for another reason (EOS, length, abort): return the text still
        held back, without a trailing incomplete character (a full decode would end in '\\ufffd'
        there; OpenAI's API drops it). A stop string inside that text still cuts it, so a stop string
        is never emitted."""
        if self._stopped:
            return self._take(len(self._text))
        old_len = len(self._text)
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(self._prefix_text):
            self._text += new_text[len(self._prefix_text):].rstrip(REPLACEMENT_CHAR)
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = ""
        match = self._find_stop(old_len)
        if match is not None:
            start, stop = match
            self._text = self._text[:start + len(stop) if self.include_stop else start]
        self._stopped = True
        return self._take(len(self._text))

    @property
    def output_text(self) -> str:
        """Everything emitted so far (after flush or a stop, the whole output)."""
        return self._text[:self._num_emitted]

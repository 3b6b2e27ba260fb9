"""Max-Gram (MaG) drafting with a bigram fallback, the statistical bottom drafter of Cascade
Speculative Drafting (Chen et al. 2024, §3.3 and Appendix A).

1. **Max-Gram**: find the longest suffix of the sequence (prompt + generation so far) that also
   occurs earlier in it, growing the suffix one token at a time while an occurrence survives, and
   propose the tokens that followed the leftmost surviving occurrence (the paper's listing; the
   most recent one with `leftmost=False`).
2. **Bigram fallback**: when even the last token never occurred before, propose the greedy chain
   `t -> table[t] -> ...` of a V-entry table "token -> most frequent next token" counted with the
   target's tokenizer over a text corpus (the paper uses Wikipedia; we default to the training
   prompt pool `train_prompts.jsonl` of the shared data folder). The table is built on first use
   and cached under the specserve cache dir.

Both are greedy, so drafts are deterministic (one-hot q: `draft_probs=None`) and a chain.

Decisions beyond the paper:
* The paper's source is the prompt, which ends; ours is the sequence itself, which goes on with the
  suffix. When the occurrence ends p < max_tokens tokens before the suffix does, copying on means
  copying the draft itself, i.e. repeating the last p tokens (a loop). So a match always yields the
  full `max_tokens` and the bigram is used only when there is no match at all (as in the paper).
* The suffix grows to at most `max_match` tokens (default 64): growing one token at a time costs
  O(survivors) per token, which is O(n^2) for a sequence stuck in a short loop. Beyond 64 matched
  tokens the choice of occurrence hardly matters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence as Seq

import numpy as np

from specserve.drafters.base import Drafter, DrafterContext, register
from specserve.engine.data_dir import data_dir
from specserve.engine.loader import _cache_root
from specserve.engine.tree import TokenTree

logger = logging.getLogger("specserve")

NO_NEXT_TOKEN = -1          # bigram table entry of a token never followed by anything in the corpus
BIGRAM_CACHE_VERSION = 1
DEFAULT_CORPUS = "train_prompts.jsonl"


# ----------------------------------------------------------------------------- Max-Gram

def max_gram_match(tokens: np.ndarray, leftmost: bool = True, max_match: int | None = None) -> tuple[int, int] | None:
    """`(end, length)` of the chosen earlier occurrence `tokens[end-length+1 : end+1]` of the longest
    suffix of `tokens` that recurs, or None if the last token never occurred before.

    An earlier occurrence must end before the last position (the suffix itself is no match); it
    may overlap the suffix. `ends` holds the end positions of the occurrences of the current
    k-token suffix; one step keeps those preceded by the suffix's next token to the left (the
    paper's boolean match vectors, kept as index arrays).

    Example: `tokens = a b c x a b c y b c` (n = 10).
      k=1 suffix `c`:     ends {2, 6}
      k=2 suffix `b c`:   tokens[1] = tokens[5] = b = tokens[8] -> ends {2, 6}
      k=3 suffix `y b c`: tokens[0] = a, tokens[4] = a != y -> none survive; stop.
    The longest recurring suffix is `b c` (length 2), leftmost occurrence ends at 2 -> (2, 2);
    the most recent ends at 6 -> (6, 2).
    """
    tokens = np.asarray(tokens)                          # [n]
    n = len(tokens)
    if n < 2:
        return None
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])     # [num_occurrences]
    if ends.size == 0:
        return None
    k, limit = 1, max_match or n
    while k < limit:
        longer = ends[ends >= k]                          # room for one more token on the left
        longer = longer[tokens[longer - k] == tokens[n - 1 - k]]
        if longer.size == 0:
            break
        ends, k = longer, k + 1
    return int(ends[0] if leftmost else ends[-1]), k


def max_gram(tokens: np.ndarray, max_tokens: int, leftmost: bool = True, max_match: int | None = None) -> list[int]:
    """Up to `max_tokens` tokens that follow the chosen occurrence of the longest recurring suffix
    (see `max_gram_match`); [] when there is none.

    With the occurrence ending at e and the suffix at n-1 (shift p = n-1-e >= 1), the draft copies
    the sequence as if it continued like the occurrence: draft[m] = ext[e+1+m] with ext = tokens +
    draft, which is `tokens[e+1 + (m mod p)]`: a plain copy when p >= max_tokens, else a loop over
    the last p tokens.

    Example: `a b c x a b c y b c` -> `b c` ended at 2 (p = 7) -> copies `x a b c y b c`, then
    copies its own first tokens: `x a b c y b c x a b` for max_tokens = 10.
    """
    tokens = np.asarray(tokens)
    match = max_gram_match(tokens, leftmost, max_match) if max_tokens > 0 else None
    if match is None:
        return []
    end, _ = match
    shift = len(tokens) - 1 - end
    return tokens[end + 1 + np.arange(max_tokens) % shift].tolist()


# ----------------------------------------------------------------------------- bigram fallback

def bigram_table(token_lists: Iterable[Seq[int]], vocab_size: int) -> np.ndarray:
    """[vocab_size] int32: for each token the most frequent next token over the documents (pairs
    never cross documents; ties -> the smallest id), NO_NEXT_TOKEN if never followed. Ids outside
    [0, vocab_size) are ignored."""
    table = np.full(vocab_size, NO_NEXT_TOKEN, dtype=np.int32)
    keys = []
    for ids in token_lists:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size < 2:
            continue
        a, b = ids[:-1], ids[1:]
        ok = (a >= 0) & (a < vocab_size) & (b >= 0) & (b < vocab_size)
        keys.append(a[ok] * vocab_size + b[ok])
    if not keys:
        return table
    pairs, counts = np.unique(np.concatenate(keys), return_counts=True)   # [num_pairs] sorted
    first, second = pairs // vocab_size, pairs % vocab_size
    order = np.lexsort((second, -counts, first))          # by first, then count desc, then id asc
    first, second = first[order], second[order]
    head = np.ones(len(first), dtype=bool)
    head[1:] = first[1:] != first[:-1]                    # the best pair of each first token
    table[first[head]] = second[head]
    return table


def bigram_chain(table: np.ndarray | None, root: int, max_tokens: int) -> list[int]:
    """Greedy chain root -> table[root] -> ..., up to max_tokens, stopping at an unknown token."""
    out: list[int] = []
    tok = root
    while table is not None and len(out) < max_tokens and 0 <= tok < len(table):
        tok = int(table[tok])
        if tok == NO_NEXT_TOKEN:
            break
        out.append(tok)
    return out


def corpus_texts(path: Path) -> list[str]:
    """Documents of a corpus file: for .jsonl every string of a row's `turns` plus its `output`
    or `text` field (the `{id, category, turns, output}` format of the shared data folder); for
    other files (plain text) the paragraphs separated by blank lines."""
    if path.suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                fields = [*(row.get("turns") or []), row.get("output"), row.get("text")]
                texts.extend(t for t in fields if isinstance(t, str) and t)
        return texts
    return [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def tokenize_corpus(tokenizer, texts: list[str], batch: int = 4096) -> Iterable[list[int]]:
    """Token ids of each text, no special tokens (the Rust backend's batch encoder when there is one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    for i in range(0, len(texts), batch):
        chunk = texts[i:i + batch]
        if backend is not None:
            yield from (e.ids for e in backend.encode_batch(chunk, add_special_tokens=False))
        else:
            yield from tokenizer(chunk, add_special_tokens=False)["input_ids"]


def default_corpus() -> Path:
    return data_dir() / DEFAULT_CORPUS


def bigram_cache_key(tokenizer, corpus: Path, vocab_size: int) -> str:
    """16 hex digits over the tokenizer's vocabulary (token -> id) and the corpus file's resolved
    path, size and mtime: a new tokenizer or an edited corpus gets a new table."""
    st = corpus.stat()
    h = hashlib.sha256(f"specserve-mag-bigram-v{BIGRAM_CACHE_VERSION}:{vocab_size}:".encode())
    h.update(type(tokenizer).__name__.encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(f":{corpus.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def load_bigram_table(tokenizer, vocab_size: int, corpus: str | os.PathLike | None = None,
                      cache_dir: str | os.PathLike | None = None) -> np.ndarray | None:
    """The bigram table of `corpus` (default: the shared training prompts) under `tokenizer`, read
    from `<cache>/mag/bigram-<key>.npy` or built and written there atomically. None, with a
    warning, when the corpus is missing or cannot be read: MaG then runs without the fallback."""
    try:
        path = Path(corpus).expanduser() if corpus is not None else default_corpus()
        if not path.is_file():
            logger.warning("mag: bigram corpus %s not found; drafting without the bigram fallback", path)
            return None
        cache = _cache_root(cache_dir) / "mag" / f"bigram-{bigram_cache_key(tokenizer, path, vocab_size)}.npy"
        if cache.is_file():
            try:
                table = np.load(cache)
                if table.shape == (vocab_size,) and table.dtype == np.int32:
                    return table
            except (OSError, ValueError):
                pass
            logger.warning("mag: unreadable bigram cache %s; rebuilding", cache)
        table = bigram_table(tokenize_corpus(tokenizer, corpus_texts(path)), vocab_size)
    except Exception:   # never fail a server over the fallback
        logger.warning("mag: could not build the bigram table; drafting without the fallback", exc_info=True)
        return None
    logger.info("mag: bigram table of %s: %d tokens with a successor", path, int((table != NO_NEXT_TOKEN).sum()))
    _save_atomic(cache, table)
    return table


def _save_atomic(path: Path, table: np.ndarray) -> None:
    """Write to a temporary file beside `path`, then rename: readers never see a partial table.
    A failed write only costs the cache."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            tmp = f.name
            np.save(f, table)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("mag: could not cache the bigram table in %s: %s", path, e)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- drafter

@register("mag")
class MaxGramDrafter(Drafter):
    """Options: `max_tokens` draft length (the paper's 10), `leftmost` occurrence (paper) or most
    recent, `bigram` fallback on/off, `corpus` path for the bigram table (.jsonl or text),
    `max_match` cap on the matched suffix length (None = unbounded, as in the paper), `cache_dir`
    for the bigram table (default `$SPECSERVE_CACHE` or ~/.cache/specserve)."""

    name = "mag"
    drafts_after_uncommitted = True   # see Drafter; hypothetical tokens go to a copy
    request_options = ("max_tokens",)

    def __init__(self, ctx: DrafterContext | None = None, *, max_tokens: int = 10, bigram: bool = True,
                 corpus: str | None = None, leftmost: bool = True, max_match: int | None = 64,
                 cache_dir: str | None = None):
        ctx = ctx or DrafterContext()
        tokenizer, model_config = ctx.tokenizer, ctx.model_config
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if max_match is not None and max_match < 1:
            raise ValueError("max_match must be >= 1 or None")
        self.max_tokens, self.leftmost, self.max_match = max_tokens, leftmost, max_match
        self.vocab_size = max(getattr(model_config, "vocab_size", 0) or 0,
                              len(tokenizer) if tokenizer is not None else 0)   # table entries
        # built (or read from the cache) now, at load time, so no request waits for it
        self.bigram: np.ndarray | None = None
        if bigram and tokenizer is None:
            logger.warning("mag: no tokenizer given; drafting without the bigram fallback")
        elif bigram:
            self.bigram = load_bigram_table(tokenizer, self.vocab_size, corpus, cache_dir)
        # seq_id -> (int32 buffer, number of valid tokens): saves re-converting the whole list every step
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}

    def context_of(self, seq) -> int:
        """The length of the recurring suffix the draft copies from, in classes 1, 2, 3, 4 (4-7)
        and 8 (8 or more); 0 when none recurs (the bigram fallback drafts)."""
        match = max_gram_match(self._tokens(seq), self.leftmost, self.max_match)
        if match is None:
            return 0
        k = match[1]
        return k if k < 4 else 4 if k < 8 else 8

    def propose(self, seqs, budgets) -> list[TokenTree | None]:
        trees = []
        for seq, budget in zip(seqs, budgets):
            want = min((getattr(seq, "options", None) or {}).get("max_tokens", self.max_tokens), budget)
            if want <= 0:
                trees.append(None)
                continue
            drafts = max_gram(self._tokens(seq), want, self.leftmost, self.max_match)
            if not drafts and self.bigram is not None:
                drafts = bigram_chain(self.bigram, seq.token_ids[-1], want)
            trees.append(TokenTree.chain(seq.token_ids[-1], drafts) if drafts else None)
        return trees

    @classmethod
    def check_request_options(cls, options: dict) -> dict:
        options = super().check_request_options(options)
        value = options.get("max_tokens", 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"mag option max_tokens must be a positive integer, got {value!r}")
        return options

    def finish(self, seq) -> None:
        self._buffers.pop(seq.seq_id, None)

    def _tokens(self, seq) -> np.ndarray:
        """seq.token_ids as an int32 array [n], appending only the committed tokens new since the
        last call (sequences only grow; a buffer that disagrees with the list is rebuilt);
        hypothetical tokens of an extended prefix are appended to a copy, never buffered."""
        hyp = tuple(getattr(seq, "hypothetical", ()))
        ids = seq.token_ids[:len(seq.token_ids) - len(hyp)] if hyp else seq.token_ids
        n = len(ids)
        buf, filled = self._buffers.get(seq.seq_id, (None, 0))
        if buf is None or filled > n or (filled and buf[filled - 1] != ids[filled - 1]):
            buf, filled = np.empty(max(2 * n, 64), dtype=np.int32), 0
        elif n > len(buf):
            buf = np.concatenate([buf[:filled], np.empty(2 * n - filled, dtype=np.int32)])
        buf[filled:n] = ids[filled:]
        self._buffers[seq.seq_id] = (buf, n)
        if hyp:
            return np.concatenate([buf[:n], np.asarray(hyp, dtype=np.int32)])
        return buf[:n]

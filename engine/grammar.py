"""Structured output: a request's grammar as a token mask on every row, each along its own path.

A request may constrain its output (`SamplingParams.guided`, kind and text): a JSON schema
(`json`), a regular expression (`regex`), one of a list of strings (`choice`), or a Lark grammar
(`grammar`; a GBNF grammar, `root ::= ...`, is converted). llguidance compiles it against the
target's tokenizer (`Grammars`, one per engine: the tokenizer is wrapped once, each distinct
grammar compiled once and copied per sequence) and answers, for a grammar state, which tokens may
come next (a bitmask, bit v of 32-bit word v // 32).

Each sequence holds a matcher at the state after its committed output (`GrammarState`). A plain row
is masked with that state's mask. A draft tree's node continues the output with its own path, so
node i is masked with the state after the path root -> i: a depth-first walk consumes each node's
token, takes the mask, visits the children and rolls back (`tree_masks`). A node whose token the
grammar forbids after its parent's path gets probability 0 under the masked target, so no walk ever
accepts it (greedy, keyed and rejection sampling alike); its row's mask is never read, and it
takes its parent's. Only the committed tokens advance the matcher (`advance`).

So a masked request commits exactly what plain decoding with the same mask commits: greedy token
for token, sampling in law; EOS is allowed only where the grammar may end, and a grammar that
cannot finish within max_tokens ends with "length".
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict

import numpy as np
import torch

from specserve.engine.errors import InvalidRequestError

GUIDED_KINDS = ("json", "regex", "choice", "grammar")
GRAMMAR_PART = "grammar"  # the drafter name of forced tokens (their part in speculative.parts, /metrics)
CACHE_SIZE = 256          # compiled grammars kept per engine


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:   # imported on first use: only structured output needs it
        raise InvalidRequestError("structured output needs the llguidance package on the server",
                                  "response_format") from exc
    return llguidance


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar of a (kind, text) request; InvalidRequestError naming what is wrong."""
    llg = _llguidance()
    M = llg.LLMatcher
    if kind == "json":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", "response_format") from exc
        if schema is True or schema == {}:
            schema = {"type": "object"}
        # compact JSON: with whitespace allowed between values, a model can write newlines until max_tokens
        return M.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
    if kind == "regex":
        return M.grammar_from_regex(text)
    if kind == "choice":
        choices = json.loads(text)
        if not choices or not all(isinstance(c, str) for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of strings", "structured_outputs")
        return M.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark
        return M.grammar_from_lark(any_to_lark(text))      # GBNF converted, Lark as it is
    raise InvalidRequestError(f"unknown structured output kind {kind!r}", "structured_outputs")


def tokenizer_json(hf_tokenizer) -> str:
    """The fast tokenizer's JSON as llguidance should read it (padding and truncation off).

    llguidance takes each token's bytes from the JSON, choosing how to read token strings from the
    decoder. The tokenizer transformers builds from a GGUF's byte-level BPE (SmolLM2's) has the
    decoder Sequence[ByteFallback, Fuse, Replace("▁", " "), ByteLevel]: on a byte-level vocabulary
    only the ByteLevel part ever changes a token, but llguidance, seeing ByteFallback, reads the
    strings as their own UTF-8 bytes, so "Ġbecause" became b"\\xc4\\xa0because" and no grammar could
    emit a space. Where the pre-tokenizer is ByteLevel (every token string is byte-level encoded)
    and the decoder a Sequence holding a ByteLevel step, llguidance gets that ByteLevel step alone."""
    backend = copy.copy(hf_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    decoder, pre = spec.get("decoder") or {}, spec.get("pre_tokenizer") or {}
    pre_steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if decoder.get("type") == "Sequence" and any(step.get("type") == "ByteLevel" for step in pre_steps):
        byte_level = [step for step in decoder.get("decoders", []) if step.get("type") == "ByteLevel"]
        if byte_level:
            spec["decoder"] = byte_level[0]
    return json.dumps(spec)


class Grammars:
    """One engine's llguidance tokenizer and its cache of compiled grammars."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()     # the server compiles off the event loop, the engine thread copies

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(tokenizer_json(self._hf), n_vocab=self.vocab_size,
                                              eos_token=self._eos)
        return self._tokenizer

    def compile(self, guided: tuple[str, str]):
        """The compiled matcher of `guided` at its start (cached); InvalidRequestError if it does not compile."""
        with self._lock:
            hit = self._compiled.get(guided)
            if hit is not None:
                self._compiled.move_to_end(guided)
                return hit
        llg = _llguidance()
        param = "response_format" if guided[0] == "json" else "structured_outputs"
        try:
            text = grammar_text(*guided)
            error = llg.LLMatcher.validate_grammar(text, self.tokenizer)
            matcher = None if error else llg.LLMatcher(self.tokenizer, text)
        except InvalidRequestError:
            raise
        except Exception as exc:   # noqa: BLE001 - llguidance raises plain exceptions for what it cannot read
            raise InvalidRequestError(f"the {guided[0]} constraint does not compile: {exc}", param) from exc
        if error:
            raise InvalidRequestError(f"the {guided[0]} constraint does not compile: {error.strip()}", param)
        if matcher.is_error():
            raise InvalidRequestError(f"the {guided[0]} constraint does not compile: {matcher.get_error()}",
                                      "structured_outputs")
        with self._lock:
            self._compiled[guided] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def state(self, guided: tuple[str, str]) -> "GrammarState":
        return GrammarState(self.compile(guided).deep_copy(), self._eos)


class GrammarState:
    """A sequence's matcher, at the state after its committed output."""

    def __init__(self, matcher, eos_token_ids=()):
        self.matcher = matcher
        self.eos_token_ids = frozenset(eos_token_ids)
        self._forced: list[int] | None = None

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: `{"`, a key's name,
        `":` ...), drafted for free (`forced_tree`); cached until the state moves."""
        if self._forced is None:
            self._forced = [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())
        return self._forced

    def mask(self) -> np.ndarray:
        """[words] int32: the tokens allowed next."""
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32).copy()

    def tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[np.ndarray, list[int]]:
        """Per node of a tree rooted at the last committed token, the tokens allowed after its path:
        ([len(allowed), words] int32, allowed), `allowed` the nodes (increasing, the root first) whose
        path the grammar accepts; a node its parent's state forbids, and its subtree, are left out."""
        n, m = len(tokens), self.matcher
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        masks = {0: self.mask()}

        def visit(node: int) -> None:             # depth-first: consume, take the mask, recurse, roll back
            for c in children[node]:
                if tokens[c] in self.eos_token_ids:   # the output ends there: allowed where the mask allows
                    if allows(masks[node], tokens[c]):    # it (a matcher that has stopped consumes no EOS);
                        masks[c] = masks[node]            # nothing after it is (its row's mask is never read)
                    continue
                if m.try_consume_tokens([tokens[c]]) == 1:
                    masks[c] = self.mask()
                    visit(c)
                    m.rollback(1)

        visit(0)
        allowed = sorted(masks)
        return np.stack([masks[i] for i in allowed]), allowed

    def masks_after(self, prefix: list[int], paths: list[list[int]]) -> np.ndarray:
        """[len(paths), words] int32: per path, the tokens allowed after prefix + path (a drafter's
        hypothetical continuations); a path the grammar forbids, or that ends in EOS, gets an all-ones
        row (what is drawn after it does not matter). The state is left as it was."""
        m = self.matcher
        rows: list[np.ndarray | None] = [None] * len(paths)
        base = m.try_consume_tokens(list(prefix)) if prefix else 0
        if base == len(prefix):
            for i, path in enumerate(paths):
                if self.eos_token_ids.intersection(path):   # the output has ended on this path
                    continue
                n = m.try_consume_tokens(list(path)) if path else 0
                if n == len(path):
                    rows[i] = self.mask()
                if n:
                    m.rollback(n)
        if base:
            m.rollback(base)
        words = next((r.shape[0] for r in rows if r is not None), 0) or self.mask().shape[0]
        return np.stack([r if r is not None else np.full(words, -1, dtype=np.int32) for r in rows])

    def prune(self, tree, exact: bool):
        """(tree, masks, kept): `tree` without the drafts the grammar forbids, the mask of each node
        kept, and the kept nodes' indices in `tree` (None when nothing was cut).

        A forbidden draft has target probability 0 under the mask, so verification would reject it;
        cutting it first saves its row and changes no output where its rejection changes nothing
        else: greedy and seeded verification (a draft is accepted iff it is the target's own token),
        and a deterministic draft in sampling (its rejection leaves p = norm(max(0, p - onehot)) = p).
        A rejected stochastic draft moves the residual, so `exact` (any of those three cases) must
        hold for the cut; otherwise the tree stays whole, forbidden nodes masked with their parent's
        mask."""
        masks, allowed = self.tree_masks(tree.tokens, tree.parents)
        if len(allowed) == tree.num_nodes:
            return tree, masks, None
        if exact:
            return tree.subtree(allowed), masks, allowed
        full = np.empty((tree.num_nodes, masks.shape[1]), dtype=np.int32)
        row = {node: i for i, node in enumerate(allowed)}
        for i in range(tree.num_nodes):           # never accepted: whatever mask, their parent's
            j = i
            while j not in row:
                j = tree.parents[j]
            full[i] = masks[row[j]]
        return tree, full, None

    def advance(self, tokens: list[int]) -> None:
        """Consume the committed tokens (each allowed by the masks they were drawn under)."""
        self.matcher.consume_tokens(tokens)
        self._forced = None


def forced_tree(root: int, tokens: list[int]):
    """The chain of forced `tokens` after `root`, as the grammar part's draft. A deterministic draft
    like any other: verified against the masked target, so it changes no output; a forced token is
    accepted unless the target prefers another tokenisation of the same text."""
    from specserve.engine.tree import TokenTree

    tree = TokenTree.chain(root, tokens)
    tree.sources, tree.source_names = [0] * tree.num_nodes, (GRAMMAR_PART,)
    return tree


def is_forced_tree(tree) -> bool:
    return tree.source_names == (GRAMMAR_PART,)


def split_forced(tree, num_accepted: int) -> tuple[int, int, int]:
    """(k, draft nodes, accepted tokens) of the drafter's part of `tree`: k = `grammar_prefix(tree)`
    forced nodes first (0: the whole tree is the drafter's), then its nodes, of which accepted are
    those of the `num_accepted` (a path from the root) beyond the forced chain."""
    k = grammar_prefix(tree)
    return k, tree.num_draft_tokens - k, max(0, num_accepted - k)


def grammar_prefix(tree) -> int:
    """How many draft nodes of `tree` are a grammar's forced chain from its root (its first part,
    nodes 1..k; the rest, if any, a drafter's tree after them): 0 for a drafter's own tree."""
    if tree.sources is None or not tree.source_names or tree.source_names[0] != GRAMMAR_PART:
        return 0
    k = 0
    while k + 1 < tree.num_nodes and tree.sources[k + 1] == 0 and tree.parents[k + 1] == k:
        k += 1
    return k


def allows(mask: np.ndarray, token: int) -> bool:
    """Whether bit `token` of a [words] int32 mask is set."""
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def apply_masks(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """logits [..., V] with every token whose bit is 0 in masks [..., words] (int32) set to -inf."""
    words = torch.from_numpy(np.ascontiguousarray(masks)).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[..., None] >> shifts) & 1).bool().flatten(-2)[..., :logits.shape[-1]]
    return logits.float().masked_fill(~allowed, float("-inf"))

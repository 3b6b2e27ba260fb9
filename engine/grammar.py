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
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from specserve.engine.constraints import GUIDED_KINDS, check_limits, constraint_param, grammar_text  # noqa: F401
from specserve.engine.errors import ConstraintError, InvalidRequestError, QueueFullError
from specserve.engine.grammar_sandbox import DEFAULT_TIMEOUT, Sandbox, compile_error, large_stack

GRAMMAR_PART = "grammar"  # the drafter name of forced tokens (their part in speculative.parts, /metrics)
CACHE_SIZE = {"small": 256, "large": 8}   # compiled grammars kept per engine, by lane
SMALL_CONSTRAINT_BYTES = 16 * 1024   # constraints up to this size compile in the small lane
MAX_PENDING_COMPILES = 32            # compiles queued or running per lane; past it a 429


COMPILE_NICENESS = 10   # the compile threads yield the CPU to the step loop and the event loop


def lower_priority() -> None:
    """Lower this thread's CPU priority (Linux schedules threads as tasks; elsewhere a no-op)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):
        pass


def release_free_memory() -> None:
    """Give the allocator's free pages back to the system (glibc's malloc_trim): a large compile and
    its request body leave tens of MB free in the arenas of the threads that handled them."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError as exc:   # imported on first use: only structured output needs it
        raise InvalidRequestError("structured output needs the llguidance package on the server",
                                  "response_format") from exc
    return llguidance


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
    """One engine's llguidance tokenizer and its cache of compiled grammars.

    A constraint is compiled in three gates (`compile`): its sizes against `engine.constraints`'
    limits (pure Python), a compile in a sandbox child (`engine.grammar_sandbox`: a crash or a
    runaway there fails this request only), then the engine's own compile. Compiles run on this
    object's threads, which have the sandbox's large stack; the sandbox has a lane for small
    constraints and one for large ones, so heavy compiles queue behind each other, not before a
    small one."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, *, compile_timeout: float = DEFAULT_TIMEOUT,
                 sandbox: bool = True):
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_token_ids)
        self.compile_timeout, self.use_sandbox = compile_timeout, sandbox
        self._tokenizer = None
        self._tokenizer_json: str | None = None
        # compiled matchers by lane: a large constraint's lexer can hold tens of MB, so few are kept
        self._compiled: dict[str, OrderedDict[tuple[str, str], object]] = {"small": OrderedDict(),
                                                                            "large": OrderedDict()}
        self._lock = threading.Lock()     # the server compiles off the event loop, the engine thread copies
        self._lanes: dict[str, Sandbox] = {}
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._inflight: dict[tuple[str, str], Future] = {}
        self._pending: dict[str, int] = {}

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                llg = _llguidance()
                self._tokenizer_json = tokenizer_json(self._hf)
                self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                  eos_token=self._eos)
            return self._tokenizer

    def cached(self, guided: tuple[str, str]):
        with self._lock:
            cache = self._compiled[self._lane(guided)]
            hit = cache.get(guided)
            if hit is not None:
                cache.move_to_end(guided)
            return hit

    def _lane(self, guided: tuple[str, str]) -> str:
        return "small" if len(guided[1]) <= SMALL_CONSTRAINT_BYTES else "large"

    def submit(self, guided: tuple[str, str]) -> Future:
        """The compile of `guided` on its lane's thread: a Future of the matcher (or InvalidRequestError)."""
        lane = self._lane(guided)
        with self._lock:
            running = self._inflight.get(guided)
            if running is not None:          # the same constraint already compiling: one compile for both
                return running
            if self._pending.get(lane, 0) >= MAX_PENDING_COMPILES:
                raise QueueFullError(f"{MAX_PENDING_COMPILES} {lane} constraints are waiting to compile; "
                                     f"retry later", retry_after=1)
            pool = self._pools.get(lane)
            if pool is None:
                pool = self._pools[lane] = ThreadPoolExecutor(1, thread_name_prefix=f"grammar-{lane}",
                                                              initializer=lower_priority)
            with large_stack():   # the pool starts its thread on its first submit
                future = pool.submit(self._compile, guided, lane)
            self._inflight[guided] = future
            self._pending[lane] = self._pending.get(lane, 0) + 1

        def done(_):
            with self._lock:
                self._inflight.pop(guided, None)
                self._pending[lane] -= 1

        future.add_done_callback(done)
        return future

    def compile(self, guided: tuple[str, str]):
        """The compiled matcher of `guided` at its start (cached); InvalidRequestError if it does not compile."""
        hit = self.cached(guided)
        return hit if hit is not None else self.submit(guided).result()

    def _compile(self, guided: tuple[str, str], lane: str):
        hit = self.cached(guided)
        if hit is not None:
            return hit
        try:
            return self._compile_new(guided, lane)
        finally:
            if lane == "large":
                release_free_memory()

    def _compile_new(self, guided: tuple[str, str], lane: str):
        kind, text = guided
        param = constraint_param(kind)
        llg = _llguidance()
        check_limits(kind, text)
        tokenizer = self.tokenizer
        if self.use_sandbox:
            error = self._sandbox(lane).check(kind, text)
            if error:
                raise InvalidRequestError(error, param)
        try:
            matcher = llg.LLMatcher(tokenizer, grammar_text(kind, text), log_level=0)
            # the first mask is taken on a copy: the parser state it leaves can hold MBs (4 MB for a
            # short recursive grammar), and the cached start, which every sequence copies, stays lean
            probe = matcher
            if not matcher.is_error():
                probe = matcher.deep_copy()
                probe.compute_bitmask()
        except InvalidRequestError:
            raise
        except Exception as exc:   # noqa: BLE001 - llguidance raises plain exceptions for what it cannot read
            raise InvalidRequestError(compile_error(kind, str(exc)), param) from exc
        if probe.is_error():
            raise InvalidRequestError(compile_error(kind, probe.get_error()), param)
        del probe
        with self._lock:
            cache = self._compiled[lane]
            cache[guided] = matcher
            while len(cache) > CACHE_SIZE[lane]:
                cache.popitem(last=False)
        return matcher

    def _sandbox(self, lane: str) -> Sandbox:
        with self._lock:
            box = self._lanes.get(lane)
            if box is None:
                box = self._lanes[lane] = Sandbox(self._tokenizer_json, self.vocab_size, self._eos,
                                                  timeout=self.compile_timeout, name=lane)
            return box

    def state(self, guided: tuple[str, str], start=None) -> "GrammarState":
        """A sequence's state at the start of `guided`: copied from `start` (the compiled matcher the
        server handed over with the request) or from the cache, compiling it if it is not there."""
        start = start if start is not None else self.compile(guided)
        return GrammarState(start.deep_copy(), self._eos, guided[0], start=start)

    def close(self) -> None:
        """Stop the sandbox children and the compile threads."""
        for box in list(self._lanes.values()):
            box.close()
        for pool in list(self._pools.values()):
            pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """A sequence's matcher, at the state after its committed output."""

    def __init__(self, matcher, eos_token_ids=(), kind: str = "grammar", start=None):
        self.matcher = matcher
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kind = kind
        self._start = start if start is not None else matcher.deep_copy()   # never moved: rebuilt from
        self._committed: list[int] = []   # the tokens consumed since the start
        self._forced: list[int] | None = None
        self._mask: np.ndarray | None = None   # the committed state's mask, once computed

    def _failed(self) -> ConstraintError:
        """The error that ends the request: the matcher is in error on its committed path."""
        error = (self.matcher.get_error() or "unknown error").strip().splitlines()[0][:400]
        return ConstraintError(f"the {self.kind} constraint failed during generation after "
                               f"{len(self._committed)} tokens: {error}")

    def _rebuild(self, extra: list[int]) -> None:
        """After a speculative path put the matcher in error (sticky in llguidance): a fresh copy of
        the start, at the committed tokens plus `extra`."""
        self.matcher = self._start.deep_copy()
        self.matcher.consume_tokens(self._committed + list(extra))

    def _path_mask(self) -> np.ndarray | None:
        """The mask at the matcher's current (speculative) state, None if it is in error there."""
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)
        return None if self.matcher.is_error() else mask.copy()

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (llguidance's fast-forward tokens: `{"`, a key's name,
        `":` ...), drafted for free (`forced_tree`); cached until the state moves."""
        if self._forced is None:
            self._forced = [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())
            if self.matcher.is_error():   # a limit hit looking ahead, which plain decoding does not do:
                self._rebuild([])         # no forced drafts, the committed state as it was
                self._forced = []
        return self._forced

    def mask(self) -> np.ndarray:
        """[words] int32: the tokens allowed next; ConstraintError if the matcher is in error."""
        if self._mask is None:
            if self.matcher.is_error():
                raise self._failed()
            mask = self._path_mask()
            if mask is None:
                raise self._failed()
            self._mask = mask
        return self._mask.copy()

    def tree_masks(self, tokens: list[int], parents: list[int]) -> tuple[np.ndarray, list[int]]:
        """Per node of a tree rooted at the last committed token, the tokens allowed after its path:
        ([len(allowed), words] int32, allowed), `allowed` the nodes (increasing, the root first) whose
        path the grammar accepts; a node its parent's state forbids, and its subtree, are left out."""
        n = len(tokens)
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[parents[i]].append(i)
        masks = {0: self.mask()}
        path: list[int] = []

        def visit(node: int) -> None:             # depth-first: consume, take the mask, recurse, roll back
            for c in children[node]:
                if tokens[c] in self.eos_token_ids:   # the output ends there: allowed where the mask allows
                    if allows(masks[node], tokens[c]):    # it (a matcher that has stopped consumes no EOS);
                        masks[c] = masks[node]            # nothing after it is (its row's mask is never read)
                    continue
                consumed = self.matcher.try_consume_tokens([tokens[c]]) == 1
                mask = self._path_mask() if consumed else None
                if mask is None and self.matcher.is_error():
                    # a limit of the grammar engine hit on this draft: cut like a forbidden draft (a target
                    # that commits this token fails the request in `advance`, as plain decoding would)
                    self._rebuild(path)
                    continue
                if consumed:
                    masks[c] = mask
                    path.append(tokens[c])
                    visit(c)
                    path.pop()
                    self.matcher.rollback(1)

        visit(0)
        allowed = sorted(masks)
        return np.stack([masks[i] for i in allowed]), allowed

    def masks_after(self, prefix: list[int], paths: list[list[int]]) -> np.ndarray:
        """[len(paths), words] int32: per path, the tokens allowed after prefix + path (a drafter's
        hypothetical continuations); a path the grammar forbids, or that ends in EOS, gets an all-ones
        row (what is drawn after it does not matter). The state is left as it was."""
        words = self.mask().shape[0]
        rows: list[np.ndarray | None] = [None] * len(paths)
        base = self.matcher.try_consume_tokens(list(prefix)) if prefix else 0
        if base == len(prefix) and not self.matcher.is_error():
            for i, path in enumerate(paths):
                if self.eos_token_ids.intersection(path):   # the output has ended on this path
                    continue
                n = self.matcher.try_consume_tokens(list(path)) if path else 0
                if n == len(path):
                    rows[i] = self._path_mask()
                if self.matcher.is_error():     # a limit hit on this path: a forbidden path's row
                    self._rebuild(prefix)
                elif n:
                    self.matcher.rollback(n)
        if self.matcher.is_error():
            self._rebuild([])
        elif base:
            self.matcher.rollback(base)
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
        """Consume the committed tokens (each allowed by the masks they were drawn under) and take the
        next mask: ConstraintError where the matcher goes into error (a limit of the grammar engine),
        so the request ends with that error and never with a "stop" its constraint did not allow."""
        self._forced, self._mask = None, None
        if self.matcher.is_stopped():     # the grammar has ended: its mask allowed only its EOS, which
            self._committed += tokens    # ends the output (or, for an engine without that EOS, repeats)
            return
        try:
            self.matcher.consume_tokens(tokens)
        except Exception:   # noqa: BLE001 - llguidance raises where it also goes into error
            if not self.matcher.is_error():
                raise
        self._committed += tokens
        if self.matcher.is_error():
            raise self._failed()
        if not self.matcher.is_stopped():
            self.mask()


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

"""Per-request and per-sequence state. A request with n choices owns n sequences."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence as Seq

from specserve.engine.outputs import RequestMetrics, TokenLogprob
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.stats import RequestSpecStats


_NO_OPTIONS: Mapping = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """What a drafter sees of one sequence (start/propose/observe/accept/finish): a read-only view
    the engine builds, so drafters are testable without the engine and its internals never leak.

    `token_ids` = the committed prefix (prompt + output) followed by `hypothetical` tokens, if
    any; its last token is the tree root. A drafter asked to propose from an **extended prefix**
    (e.g. by a cascade drafter that wants a draft after a hypothetical continuation) drafts as if
    those tokens were committed, but must not let them into its committed state: only the first
    `num_committed` tokens are final. `extra_roots` are the target's other samples for the root's
    position (MCSD target-initialised roots, a lossy opt-in; empty otherwise); `options` the
    request's own options for this drafter. `sample_key` is the key of a seeded sequence's keyed
    randomness (`engine.sampler`), None when unseeded: a seeded sequence's drafts are accepted
    exactly when they equal the target's keyed sample, with probability p(x) for a draft x, so a
    drafter serves it best with its most likely tokens rather than samples."""

    seq_id: int
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    params: SamplingParams
    sample_key: int | None = None
    options: Mapping | None = None   # None: no options (read as an empty mapping)
    extra_roots: tuple[int, ...] = ()
    num_committed: int = -1          # -1: every token is committed
    # the request's processing of the target's logits (penalties, bias, min_tokens, grammar) for a
    # drafter that draws or ranks drafts from its own (`engine.logits_processing.DraftLaw`); None
    # when the request asks for none, and outside `propose`
    law: Any = None

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", _NO_OPTIONS)
        if self.num_committed < 0:
            object.__setattr__(self, "num_committed", len(self.token_ids))
        elif self.num_committed > len(self.token_ids):
            raise ValueError("num_committed exceeds the tokens")

    @classmethod
    def of(cls, seq: "Sequence", hypothetical: Seq[int] = (), law: Any = None) -> "DraftRequest":
        """The view of `seq`; with `hypothetical` tokens after its committed prefix (e.g. a grammar's
        forced tokens), the view of that extended prefix (no extra roots then)."""
        if hypothetical:
            return cls(seq.seq_id, (*seq.token_ids, *hypothetical), seq.num_prompt_tokens, seq.params,
                       seq.sample_key, seq.options or _NO_OPTIONS, (), len(seq.token_ids), law)
        return cls(seq.seq_id, tuple(seq.token_ids), seq.num_prompt_tokens, seq.params, seq.sample_key,
                   seq.options or _NO_OPTIONS, tuple(seq.alt_roots) if seq.held_back else (), -1, law)

    @property
    def hypothetical(self) -> tuple[int, ...]:
        """Tokens after the committed prefix that the draft should assume (empty normally)."""
        return self.token_ids[self.num_committed:]

    @property
    def committed_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[:self.num_committed]

    @property
    def is_extended(self) -> bool:
        return self.num_committed < len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The output so far, hypothetical tokens included."""
        return self.token_ids[self.num_prompt_tokens:]

    def processed(self, logits, paths: Seq[Seq[int]]):
        """logits [n, V] of n draft nodes of this sequence, `paths` each node's tokens after the root
        (the root excluded) -> the logits the target's law would have there after the request's
        processing (`law`); unchanged when it has none."""
        return logits if self.law is None else self.law.apply(self, logits, paths)

    def extend(self, tokens: Seq[int]) -> "DraftRequest":
        """The same sequence with `tokens` appended hypothetically (the root becomes tokens[-1])."""
        if not tokens:
            return self
        return DraftRequest(self.seq_id, self.token_ids + tuple(int(t) for t in tokens), self.num_prompt_tokens,
                            self.params, self.sample_key, self.options, (), self.num_committed,
                            self.law)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One choice of a request: its tokens, how many of them have KV in the cache, its stop state."""

    def __init__(self, request: "Request", index: int, prompt_token_ids: list[int], detokenizer,
                 sample_key: int | None = None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.params: SamplingParams = request.params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0          # tokens whose KV is in the cache
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.detokenizer = detokenizer
        self.sample_key = sample_key          # seeded: the key of its keyed randomness (engine.sampler)
        # what the next delta will carry
        self.pending_token_ids: list[int] = []
        self.pending_text: str = ""
        self.pending_logprobs: list[TokenLogprob] = []
        self.reported_finished = False
        # the drafters that may propose for it (one, or auto's several: the draft policy picks one
        # each step) and the one proposing now; set by the engine when the drafters have started it
        self.drafters: tuple[str, ...] = ()
        self.drafter: str | None = None
        self.options: dict = {}                      # the request's own options for its drafter
        self.grammar = None                          # its structured output's state (engine/grammar.py)
        # MCSD target-initialised roots (lossy opt-in): token_ids[-1] was sampled but is held back
        # from the client until the next verification has picked it or one of `alt_roots`
        self.held_back = False
        self.alt_roots: list[int] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, req={self.request.request_id}, len={len(self.token_ids)}, {self.status.value})"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    drafter: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    spec: "RequestSpecStats" = field(default_factory=lambda: RequestSpecStats())
    error: str | None = None      # why the engine failed it (its sequences then end with "error")
    error_code: str = "request_failed"   # "constraint_failed": its output constraint failed (engine/grammar.py)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_generated_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.seqs)

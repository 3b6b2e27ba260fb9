"""Plain statistics the engine keeps; the server turns them into Prometheus metrics.

Per-part figures (`parts`, composite drafters whose trees carry provenance, see engine.tree): a
draft node counts for the part that proposed it, an accepted token for the part of the accepted
node. Summed over the parts they equal the drafter's own draft and accepted counts for the steps
whose trees had sources; trees without sources leave `parts` untouched (nothing is counted twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass
class PartStats:
    """Draft nodes proposed and draft tokens accepted for one part of a composite drafter."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def add_part_tally(parts: dict[str, PartStats], tally: Mapping[str, tuple[int, int]]) -> None:
    """Add a tree's `TokenTree.part_tally` ({part: (drafted, accepted)}) to `parts`."""
    for name, (drafted, accepted) in tally.items():
        st = parts.get(name)
        if st is None:
            st = parts[name] = PartStats()
        st.num_draft_tokens += drafted
        st.num_accepted_tokens += accepted


def count(counts: list[int], k: int) -> None:
    """One more observation of k in `counts` (index k: how often k was seen), grown as needed."""
    while len(counts) <= k:
        counts.append(0)
    counts[k] += 1


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0                 # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0      # prompt tokens prefilled (recomputation included)
    num_generation_tokens_total: int = 0  # tokens generated
    num_steps_total: int = 0
    num_step_failures_total: int = 0      # steps that raised and were retried sequence by sequence
    num_async_steps_total: int = 0        # steps launched before the last step's tokens were read
    num_failed_requests_total: int = 0    # requests the engine failed (a step, scheduling or a drafter raised)
    drafters: dict[str, "DrafterStats"] = field(default_factory=dict)   # copies, by drafter name
    # the goodput draft budget's step cost model: estimated seconds of a step of step_cost_tokens[i]
    # tokens (target forward + verification + commit); empty under the other budgets
    step_cost_tokens: list[int] = field(default_factory=list)
    step_cost_seconds: list[float] = field(default_factory=list)
    # bytes held at start-up, by component (`LLMEngine.memory_bytes`): weights, prepacked, quantized,
    # kv_cache, drafters
    memory_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestSpecStats:
    """Speculation figures of one request (all its choices), returned in its `speculative` block."""

    drafter: str | None = None
    num_draft_tokens: int = 0      # draft nodes proposed (root excluded)
    num_accepted_tokens: int = 0   # draft tokens accepted (bonus excluded)
    num_target_forwards: int = 0   # forwards that produced tokens for it (prefill's last chunk included)
    num_generated_tokens: int = 0
    # by part name (a composite drafter's parts; for drafter "auto", by the drafter of each tree)
    parts: dict[str, PartStats] = field(default_factory=dict)
    num_spec_steps: int = 0        # verification steps with a draft
    accepted_length_counts: list[int] = field(default_factory=list)   # index k: those steps accepting k drafts

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """A verification step of this request's draft tree."""
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_spec_steps += 1
        count(self.accepted_length_counts, num_accepted)

    @property
    def mean_accepted_length(self) -> float:
        """τ: tokens committed per target forward, bonus included."""
        return self.num_generated_tokens / self.num_target_forwards if self.num_target_forwards else 0.0


@dataclass
class DrafterStats:
    """Cumulative per-drafter counters (exported as Prometheus counters labelled by drafter)."""

    num_steps: int = 0                 # verification steps with a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0        # accepted + bonus
    num_fallbacks: int = 0             # steps where the drafter failed and plain decoding was used
    num_pruned_tokens: int = 0         # draft tokens a grammar forbade, cut before verification (in the drafted)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    accepted_by_depth: list[int] = field(default_factory=list)        # index d-1: accepted at depth d
    accepted_length_counts: list[int] = field(default_factory=list)   # index k: steps accepting k drafts
    budget_counts: list[int] = field(default_factory=list)   # index b: decoding sequence steps given b draft nodes
    parts: dict[str, PartStats] = field(default_factory=dict)   # by part name (composite drafters only)

    def copy(self) -> "DrafterStats":
        """A snapshot that later observations do not change."""
        out = DrafterStats(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items()})
        out.parts = {name: PartStats(p.num_draft_tokens, p.num_accepted_tokens) for name, p in self.parts.items()}
        return out

    def observe_parts(self, tally: Mapping[str, tuple[int, int]]) -> None:
        """A verified tree's per-part tally (`TokenTree.part_tally`; {} for a tree without sources)."""
        add_part_tally(self.parts, tally)

    def observe_budget(self, budget: int) -> None:
        """The scheduler gave a decoding sequence of this drafter `budget` draft nodes (0: none) this step."""
        count(self.budget_counts, budget)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        while len(self.accepted_by_depth) < num_accepted:
            self.accepted_by_depth.append(0)
        for d in range(num_accepted):
            self.accepted_by_depth[d] += 1
        count(self.accepted_length_counts, num_accepted)

"""Prompt lookup (n-gram) drafting: continue the sequence the way it continued the last time
its most recent tokens appeared in the prompt or the generation so far.

For the longest suffix n-gram (n from `max_ngram` down to `min_ngram`) that occurred earlier in
the sequence, the tokens that followed each earlier occurrence are proposed. Several matches become
a tree: one branch per distinct continuation, most recent match first, branches sharing common
prefixes. Deterministic drafts (one-hot q), so verification stays exact under sampling too.

Example: tokens `a b c d a b` with max_ngram 2: the suffix `a b` occurred at 0; what followed
was `c d a b`, so the chain `c d a b` is proposed (cut to the budget).

Stateless: a proposal from an extended prefix (`DraftRequest.hypothetical`) simply reads the
extended tokens.
"""

from __future__ import annotations

from typing import Sequence as Seq

from specserve.drafters.base import Drafter, DrafterContext, register
from specserve.engine.tree import TokenTree, trie_from_candidates


def find_continuations(tokens: Seq[int], max_ngram: int, min_ngram: int, max_len: int,
                       max_matches: int) -> list[list[int]]:
    """Continuations (each up to max_len tokens) after earlier occurrences of the longest matching
    suffix n-gram, most recent occurrence first. Empty if no suffix of length >= min_ngram recurs."""
    return _longest_match(tokens, max_ngram, min_ngram, max_len, max_matches)[1]


def _longest_match(tokens: Seq[int], max_ngram: int, min_ngram: int, max_len: int,
                   max_matches: int) -> tuple[int, list[list[int]]]:
    """(n, continuations) of `find_continuations`, n the length of the suffix matched (0: none)."""
    n_tok = len(tokens)
    for n in range(min(max_ngram, n_tok - 1), min_ngram - 1, -1):
        suffix = list(tokens[n_tok - n:])
        first = suffix[0]
        found: list[list[int]] = []
        # scan right to left over start positions whose match ends before the suffix itself
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] != first or list(tokens[start:start + n]) != suffix:
                continue
            cont = list(tokens[start + n:start + n + max_len])
            if cont and cont not in found:
                found.append(cont)
                if len(found) >= max_matches:
                    break
        if found:
            return n, found
    return 0, []


def tree_from_continuations(root: int, conts: list[list[int]], budget: int) -> TokenTree | None:
    """Merge continuations into a trie under the root (engine.tree.trie_from_candidates), the
    earlier continuations first, until the budget of draft nodes is spent."""
    return trie_from_candidates(root, conts, budget)


@register("ngram")
class NgramDrafter(Drafter):
    """Options: `max_ngram`/`min_ngram` (the suffix lengths tried, longest first), `max_depth`
    (longest continuation), `max_matches` (branches). Per request: `max_depth`, `max_matches`."""

    name = "ngram"
    drafts_after_uncommitted = True   # see Drafter; stateless
    request_options = ("max_depth", "max_matches")

    def __init__(self, ctx: DrafterContext | None = None, *, max_ngram: int = 4, min_ngram: int = 1,
                 max_depth: int = 8, max_matches: int = 3):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_matches = max_depth, max_matches

    @classmethod
    def check_request_options(cls, options: dict) -> dict:
        options = super().check_request_options(options)
        for key, value in options.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ngram option {key} must be a positive integer, got {value!r}")
        return options

    def context_of(self, seq) -> int:
        """The length of the longest recurring suffix n-gram (`min_ngram` .. `max_ngram`), 0 when
        none recurs (then `propose` returns no tree)."""
        return _longest_match(seq.token_ids, self.max_ngram, self.min_ngram, 1, 1)[0]

    def propose(self, seqs, budgets) -> list[TokenTree | None]:
        trees = []
        for seq, budget in zip(seqs, budgets):
            if budget <= 0:
                trees.append(None)
                continue
            opts = getattr(seq, "options", None) or {}
            conts = find_continuations(seq.token_ids, self.max_ngram, self.min_ngram,
                                       min(opts.get("max_depth", self.max_depth), budget),
                                       opts.get("max_matches", self.max_matches))
            trees.append(tree_from_continuations(seq.token_ids[-1], conts, budget))
        return trees

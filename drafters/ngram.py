"""Prompt lookup (n-gram) drafting: continue the sequence the way it continued the last time
its most recent tokens appeared in the prompt or the generation so far.

For the longest suffix n-gram (n from `max_ngram` down to `min_ngram`) that occurred earlier in
the sequence, the tokens that followed each earlier occurrence are proposed. Several matches become
a tree: one branch per distinct continuation, most recent match first, branches sharing common
prefixes. Deterministic drafts (one-hot q), so verification stays exact under sampling too.

Example: tokens `a b c d a b` with max_ngram 2: the suffix `a b` occurred at 0; what followed
was `c d a b`, so the chain `c d a b` is proposed (cut to the budget).
"""

from __future__ import annotations

from typing import Sequence as Seq

from specserve.drafters.base import Drafter, register
from specserve.engine.tree import NO_PARENT, TokenTree


def find_continuations(tokens: Seq[int], max_ngram: int, min_ngram: int, max_len: int,
                       max_matches: int) -> list[list[int]]:
    """Continuations (each up to max_len tokens) after earlier occurrences of the longest matching
    suffix n-gram, most recent occurrence first. Empty if no suffix of length >= min_ngram recurs."""
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
            return found
    return []


def tree_from_continuations(root: int, conts: list[list[int]], budget: int) -> TokenTree | None:
    """Merge continuations into a trie under the root, adding nodes level by level... in the
    order given until the budget of draft nodes is spent."""
    tokens, parents = [root], [NO_PARENT]
    child: dict[tuple[int, int], int] = {}
    for cont in conts:
        node = 0
        for tok in cont:
            nxt = child.get((node, tok))
            if nxt is None:
                if len(tokens) - 1 >= budget:
                    break
                nxt = len(tokens)
                tokens.append(tok)
                parents.append(node)
                child[(node, tok)] = nxt
            node = nxt
    return TokenTree(tokens, parents) if len(tokens) > 1 else None


@register("ngram")
class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_depth: int = 8, max_matches: int = 3, **_):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_depth, self.max_matches = max_depth, max_matches

    def propose(self, seqs, budgets) -> list[TokenTree | None]:
        trees = []
        for seq, budget in zip(seqs, budgets):
            if budget <= 0:
                trees.append(None)
                continue
            conts = find_continuations(seq.token_ids, self.max_ngram, self.min_ngram,
                                       min(self.max_depth, budget), self.max_matches)
            trees.append(tree_from_continuations(seq.token_ids[-1], conts, budget))
        return trees

"""The CTC drafter's drafting arithmetic against hand-worked examples: the collapse (repeats,
blanks, all-blank and empty candidates), raw candidates from the slots' top-k, and the
deduplicated trie (duplicate candidates, prefix weights, budget cut, ties, nothing to draft)."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.drafters.ctc import (BLANK, build_trie, collapse_keep, ctc_collapse, draft_trees, raw_candidates,
                                    slot_combinations)

E = BLANK


# ---------------------------------------------------------------------------------------------- collapse

@pytest.mark.parametrize("raw, collapsed", [
    ([5, 6, 7], [5, 6, 7]),
    ([5, 5, 6, 6, 6], [5, 6]),                 # adjacent repeats merge
    ([5, E, 5, 6], [5, 5, 6]),                 # a blank between repeats keeps both
    ([E, 5, E, E, 6, E], [5, 6]),              # blanks drop
    ([E, E, E], []),                           # all blank: empty
    ([], []),
    ([5, 5, E, E, 5, 5], [5, 5]),
])
def test_collapse_hand_worked(raw, collapsed):
    assert ctc_collapse(raw) == collapsed
    if raw:
        t = torch.tensor([raw])
        assert t[collapse_keep(t)].tolist() == collapsed


def test_collapse_keep_is_the_collapse_row_by_row():
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(-1, 3, (200, 6), generator=g)          # many blanks and repeats
    keep = collapse_keep(raw)
    for r, k in zip(raw.tolist(), keep.tolist()):
        assert [t for t, kept in zip(r, k) if kept] == ctc_collapse(r)


# ---------------------------------------------------------------------------------------------- candidates

def test_raw_candidates_are_the_best_slot_combinations():
    """T = 2 slots, k = 2: the four combinations by summed log-probability, best first."""
    logp = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.4]]]))      # [N=1, T=2, k=2]
    ids = torch.tensor([[[7, E], [E, 8]]])
    scores, tokens = raw_candidates(logp, ids, 3)
    assert tokens[0].tolist() == [[7, E], [7, 8], [E, E]]          # 0.30, 0.24, 0.15 (then ε 8: 0.12)
    assert scores.exp()[0].tolist() == pytest.approx([0.30, 0.24, 0.15])
    assert slot_combinations(2, 2).tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]
    scores, tokens = raw_candidates(logp, ids, 100)                  # capped at k^T
    assert tokens.shape == (1, 4, 2) and math.isclose(float(scores.exp().sum()), 0.9 * 0.9, rel_tol=1e-6)


def test_too_many_combinations_are_refused():
    with pytest.raises(ValueError, match="combinations"):
        slot_combinations(20, 6)


# ---------------------------------------------------------------------------------------------- trie

def test_trie_merges_duplicates_and_weighs_prefixes():
    """Candidates 7 8 | 7 9 | 7 8 | 6 | (empty): node 7 weighs 0.4+0.3+0.1, 7->8 0.5, 7->9 0.3, 6 0.15."""
    cands = [[7, 8], [7, 9], [7, 8], [6], []]
    weights = [0.4, 0.3, 0.1, 0.15, 0.05]
    tree = build_trie(1, cands, weights, budget=10)
    # level-major, children heaviest first: 1 -> {7 -> {8, 9}, 6}
    assert tree.tokens == [1, 7, 6, 8, 9]
    assert tree.parents == [-1, 0, 0, 1, 1]
    assert tree.draft_probs is None                       # deterministic drafts: one-hot q


@pytest.mark.parametrize("budget, tokens, parents", [
    (1, [1, 7], [-1, 0]),
    (2, [1, 7, 8], [-1, 0, 1]),                           # 7->8 (0.5) beats 7->9 (0.3) and 6 (0.15)
    (3, [1, 7, 8, 9], [-1, 0, 1, 1]),
    (4, [1, 7, 6, 8, 9], [-1, 0, 0, 1, 1]),
])
def test_trie_budget_keeps_the_heaviest_prefix_closed_nodes(budget, tokens, parents):
    tree = build_trie(1, [[7, 8], [7, 9], [7, 8], [6]], [0.4, 0.3, 0.1, 0.15], budget)
    assert (tree.tokens, tree.parents) == (tokens, parents)
    assert tree.num_draft_tokens == budget


def test_trie_of_nothing_is_no_draft():
    assert build_trie(3, [[], [], []], [0.5, 0.3, 0.2], budget=4) is None      # all-blank candidates
    assert build_trie(3, [[5]], [1.0], budget=0) is None                      # budget 0
    assert build_trie(3, [], [], budget=4) is None


def test_trie_ties_prefer_shallow_nodes_so_parents_come_first():
    """Equal weights along a chain: the budget keeps the shallowest nodes (a prefix-closed tree)."""
    tree = build_trie(0, [[4, 5, 6]], [1.0], budget=2)
    assert (tree.tokens, tree.parents) == ([0, 4, 5], [-1, 0, 1])


def test_draft_trees_collapse_and_deduplicate_the_raw_candidates():
    """T = 3, k = 2. Slot 1: a 0.7 / ε 0.3; slot 2: a 0.6 / b 0.4; slot 3: ε 0.8 / b 0.2.
    Raw candidates (a a ε, a b ε, ε a ε, ...) collapse to [a], [a, b], [a], ...: the trie has the
    root's child a once, weighted by all raw candidates that start with it."""
    a, b = 11, 12
    p = torch.tensor([[[0.7, 0.3], [0.6, 0.4], [0.8, 0.2]]])
    ids = torch.tensor([[[a, E], [a, b], [E, b]]])
    tree = draft_trees([3], p.log(), ids, [8], 8)[0]
    # all 8 combinations; weights of the collapsed prefixes:
    #   a   : every raw candidate except ε b ε (0.3*0.4*0.8) and ε b b (0.3*0.4*0.2)  -> 1 - 0.12 = 0.88
    #   b   : 0.12;  a b : a b ε + a b b + ε a b + a a b = 0.224 + 0.056 + 0.036 + 0.084 = 0.4
    #   a b ... a a b collapses to [a, b]; a b b to [a, b]; ε a b to [a, b]
    assert tree.tokens[:3] == [3, a, b] and tree.parents[:3] == [-1, 0, 0]
    assert tree.tokens[3:] == [b] and tree.parents[3:] == [1]
    weights = {}
    for c in range(8):
        raw = [ids[0, s, (c >> (2 - s)) & 1].item() for s in range(3)]
        w = float(torch.prod(torch.stack([p[0, s, (c >> (2 - s)) & 1] for s in range(3)])))
        col = tuple(ctc_collapse(raw))
        for d in range(1, len(col) + 1):
            weights[col[:d]] = weights.get(col[:d], 0.0) + w
    assert weights[(a,)] == pytest.approx(0.88) and weights[(a, b)] == pytest.approx(0.4)
    assert weights[(b,)] == pytest.approx(0.12) and set(weights) == {(a,), (b,), (a, b)}


def test_after_forced_tokens_only_the_candidates_that_begin_with_them_count():
    top_ids = torch.tensor([[[5, 9], [6, 7]]])                       # 1 sequence, 2 slots, top-2 each
    top_logp = torch.log(torch.tensor([[[0.6, 0.4], [0.7, 0.3]]]))
    whole = draft_trees([1], top_logp, top_ids, [10], 4)[0]
    assert sorted(zip(whole.parents, whole.tokens)) == [(-1, 1), (0, 5), (0, 9), (1, 6), (1, 7), (2, 6), (2, 7)]
    after = draft_trees([5], top_logp, top_ids, [10], 4, after=[[5]])[0]   # the grammar forced 5: the root
    assert after.tokens == [5, 6, 7] and after.parents == [-1, 0, 0]       # 5's continuations, heaviest first
    assert draft_trees([8], top_logp, top_ids, [10], 4, after=[[8]]) == [None]   # no candidate begins with 8

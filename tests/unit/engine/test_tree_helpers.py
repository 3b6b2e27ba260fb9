"""engine.tree's helpers for drafters, against hand-worked examples: the trie of candidate
continuations, the preference-order prefix, the Cartesian template fill, and the "prefix +
ancestors" mask of a drafter's own tree forward."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.tree import (NO_PARENT, TreeTemplate, ancestor_mask, build_tree_buffers, cartesian_fill,
                                   preference_prefix, trie_from_candidates)

A, B, C, D, E = 10, 11, 12, 13, 14


def test_trie_merges_shared_prefixes_in_candidate_order():
    tree = trie_from_candidates(5, [[A, B, C], [A, D], [E]], budget=10)
    assert tree.tokens == [5, A, B, C, D, E]
    assert tree.parents == [NO_PARENT, 0, 1, 2, 1, 0]
    cut = trie_from_candidates(5, [[A, B, C], [A, D], [E]], budget=4)        # the first 4 nodes
    assert (cut.tokens, cut.parents) == ([5, A, B, C, D], [NO_PARENT, 0, 1, 2, 1])
    dup = trie_from_candidates(5, [[A, B], [A, B], [A]], budget=10)          # duplicates vanish
    assert (dup.tokens, dup.parents) == ([5, A, B], [NO_PARENT, 0, 1])
    assert trie_from_candidates(5, [], budget=4) is None
    assert trie_from_candidates(5, [[A]], budget=0) is None


def test_trie_with_scores_keeps_the_best_nodes_level_major():
    # node scores (best candidate through the node): A .5, B .1, C .1, D .5, E .3
    tree = trie_from_candidates(5, [[A, B, C], [A, D], [E]], budget=3, scores=[0.1, 0.5, 0.3])
    assert (tree.tokens, tree.parents) == ([5, A, E, D], [NO_PARENT, 0, 0, 1])
    full = trie_from_candidates(5, [[A, B, C], [A, D], [E]], budget=10, scores=[0.1, 0.5, 0.3])
    # level-major, siblings best first: depth 1 A E, depth 2 D B (under A), depth 3 C
    assert (full.tokens, full.parents) == ([5, A, E, D, B, C], [NO_PARENT, 0, 0, 1, 1, 4])
    tie = trie_from_candidates(5, [[A, B], [C]], budget=2, scores=[1.0, 1.0])   # ties: shallower first
    assert tie.tokens == [5, A, C]
    with pytest.raises(ValueError):
        trie_from_candidates(5, [[A]], budget=2, scores=[1.0, 2.0])


def test_preference_prefix():
    assert preference_prefix([[0], [0, 0], [1], [0, 1]], 3) == [[0], [0, 0], [1]]
    assert preference_prefix([[0, 0], [1], [0]], 2) == [[0], [1]]            # not prefix-closed: level-major


def test_cartesian_fill():
    tpl = TreeTemplate.from_choices([[0], [1], [0, 0]])                    # parents -1 0 0 1, ranks 0 0 1 0
    tree = cartesian_fill(tpl, 5, [[A, B], [C]])
    assert (tree.tokens, tree.parents) == ([5, A, B, C], [NO_PARENT, 0, 0, 1])
    # the depth-2 node of rank 1 has no candidate: the tree stops before it
    tpl = TreeTemplate.from_choices([[0], [0, 0], [0, 1], [1]])            # level-major: [0] [1] [0,0] [0,1]
    tree = cartesian_fill(tpl, 5, [[A, B], [C]])
    assert (tree.tokens, tree.parents) == ([5, A, B, C], [NO_PARENT, 0, 0, 1])
    assert cartesian_fill(tpl, 5, [[A]]).tokens == [5, A]
    with pytest.raises(ValueError):
        cartesian_fill(TreeTemplate.forest(2, (1,)), 5, [[A]])


def test_ancestor_mask():
    parents = [NO_PARENT, 0, 0, 1]
    assert ancestor_mask(parents, [3]).tolist() == [[True, True, False, True]]
    assert ancestor_mask(parents, [1, 2]).tolist() == [[True, True, False], [True, False, True]]
    # equal to the verification mask's rows for whole trees
    tpl = TreeTemplate.from_branching((2, 2, 1))
    full = build_tree_buffers(tpl.parents).mask
    rows = list(range(3, 7))
    assert torch.equal(ancestor_mask(tpl.parents, rows, tpl.num_nodes), full[3:7])
    # a forest of rows hanging directly under the prefix (EAGLE's depth-1 rows): each sees itself only
    forest = [NO_PARENT, NO_PARENT, 0, 1]
    assert ancestor_mask(forest, [2, 3], 4).tolist() == [[True, False, True, False], [False, True, False, True]]

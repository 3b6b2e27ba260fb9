"""engine.tree's helpers for drafters, against hand-worked examples: the trie of candidate
continuations, the preference-order prefix, the Cartesian template fill, the "prefix +
ancestors" mask of a drafter's own tree forward, and the provenance of composite drafters' trees
(sources kept by every helper that builds a tree from other trees, the merge of parts' trees)."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.tree import (NO_PARENT, TokenTree, TreeTemplate, ancestor_mask, build_tree_buffers,
                                   cartesian_fill, merge_trees, preference_prefix, trie_from_candidates)

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


# ---- provenance -----------------------------------------------------------------------------------


def test_sources_are_validated_and_tallied():
    tree = TokenTree([5, A, B, C], [NO_PARENT, 0, 1, 0], sources=[0, 0, 0, 1], source_names=("x", "y"))
    assert tree.part_of(0) is None and tree.part_of(2) == "x" and tree.part_of(3) == "y"
    assert tree.part_tally([1, 2]) == {"x": (2, 2), "y": (1, 0)}
    assert tree.part_tally() == {"x": (2, 0), "y": (1, 0)}
    assert TokenTree([5, A], [NO_PARENT, 0]).part_tally([1]) == {}           # no sources: no parts
    with pytest.raises(ValueError, match="3 sources for 4 nodes"):
        TokenTree([5, A, B, C], [NO_PARENT, 0, 1, 0], sources=[0, 0, 0], source_names=("x",))
    with pytest.raises(ValueError, match="source 2 is not an index"):
        TokenTree([5, A], [NO_PARENT, 0], sources=[0, 2], source_names=("x", "y"))
    with pytest.raises(ValueError, match="distinct"):
        TokenTree([5, A], [NO_PARENT, 0], sources=[0, 0], source_names=("x", "x"))
    # a forest's extra roots are the target's tokens, not drafts of any part
    forest = TokenTree([5, 6, A, B], [NO_PARENT, NO_PARENT, 0, 1], sources=[0, 0, 0, 1], source_names=("x", "y"))
    assert forest.part_tally([3]) == {"x": (1, 0), "y": (1, 1)}


def test_prefix_and_tagged_keep_sources():
    probs = torch.rand(4, 7)
    tree = TokenTree([5, A, B, C], [NO_PARENT, 0, 1, 0], probs, sources=[0, 1, 0, 1], source_names=("x", "y"))
    cut = tree.prefix(3)                                                     # a budget of 2 draft nodes
    assert (cut.tokens, cut.parents, cut.sources, cut.source_names) == ([5, A, B], [NO_PARENT, 0, 1], [0, 1, 0],
                                                                         ("x", "y"))
    assert torch.equal(cut.draft_probs, probs[:3])
    assert tree.prefix(99).tokens == tree.tokens and tree.prefix(0).tokens == [5]
    plain = TokenTree([5, A, B], [NO_PARENT, 0, 0]).prefix(2)
    assert plain.sources is None and plain.tokens == [5, A]
    tagged = TokenTree([5, A, B], [NO_PARENT, 0, 0]).tagged("z")
    assert tagged.part_tally([2]) == {"z": (2, 1)}


def test_trie_from_candidates_credits_the_first_candidate_through_a_node():
    cands = [[A, B, C], [A, D], [E]]
    tree = trie_from_candidates(5, cands, budget=10, sources=[0, 1, 1], source_names=("x", "y"))
    assert tree.tokens == [5, A, B, C, D, E] and tree.sources[1:] == [0, 0, 0, 1, 1]
    assert tree.source_names == ("x", "y")
    # the same tree from the other order: A is now y's
    rev = trie_from_candidates(5, [[A, D], [A, B, C], [E]], budget=10, sources=[1, 0, 1], source_names=("x", "y"))
    assert [rev.part_of(i) for i in range(1, 6)] == ["y", "y", "x", "x", "y"]
    # with scores: kept nodes a e d (level-major) keep the source of the candidate that created them
    scored = trie_from_candidates(5, cands, budget=3, scores=[0.1, 0.5, 0.3], sources=[0, 1, 1],
                                  source_names=("x", "y"))
    assert scored.tokens == [5, A, E, D] and scored.sources[1:] == [0, 1, 1]
    assert trie_from_candidates(5, cands, budget=10).sources is None
    with pytest.raises(ValueError, match="2 sources for 3 candidates"):
        trie_from_candidates(5, cands, budget=10, sources=[0, 1], source_names=("x", "y"))


def test_merge_trees_dedups_paths_and_keeps_the_first_parts_source():
    x = TokenTree.chain(5, [A, B])                                          # 5 -> a -> b
    y = TokenTree([5, A, C, D], [NO_PARENT, 0, 1, 0])                       # 5 -> (a -> c, d)
    merged = merge_trees(5, [x, y], names=("x", "y"))
    assert merged.tokens == [5, A, B, C, D] and merged.parents == [NO_PARENT, 0, 1, 1, 0]
    assert merged.sources == [0, 0, 0, 1, 1] and merged.source_names == ("x", "y")
    # the other order: a is y's now, b is x's
    swapped = merge_trees(5, [y, x], names=("y", "x"))
    assert [swapped.part_of(i) for i in range(1, 5)] == ["y", "y", "y", "x"]
    assert swapped.tokens == [5, A, C, D, B]
    # a budget: nodes past it and their descendants are dropped, duplicates still merge
    cut = merge_trees(5, [x, y], names=("x", "y"), budget=3)
    assert (cut.tokens, cut.parents, cut.sources) == ([5, A, B, C], [NO_PARENT, 0, 1, 1], [0, 0, 0, 1])
    deep = TokenTree.chain(5, [E, A, B])
    cut = merge_trees(5, [deep, x], names=("d", "x"), budget=2)
    assert cut.tokens == [5, E, A] and cut.part_tally() == {"d": (2, 0), "x": (0, 0)}
    # nesting: a merged tree's own parts survive a second merge; None trees are skipped
    nested = merge_trees(5, [merged, None, TokenTree.chain(5, [E])], names=("xy", "none", "e"))
    assert nested.source_names == ("x", "y", "e") and nested.sources[1:] == [0, 0, 1, 1, 2]
    assert merge_trees(5, [None, TokenTree.root_only(5)], names=("a", "b")) is None
    with pytest.raises(ValueError, match="single root"):
        merge_trees(6, [x], names=("x",))
    with pytest.raises(ValueError, match="stochastic"):
        merge_trees(5, [TokenTree.chain(5, [A], torch.rand(2, 7))], names=("x",))
    with pytest.raises(ValueError, match="no name"):
        merge_trees(5, [x])

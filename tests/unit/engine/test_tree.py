"""Tree representation: templates, masks, depths and paths against hand-worked trees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.engine.tree import (NO_PARENT, TokenTree, TreeTemplate, build_tree_buffers, tree_depths,
                                   validate_parents)

TREES = Path(__file__).resolve().parents[4] / "shared" / "data" / "trees.json"


def test_hand_worked_template():
    t = TreeTemplate.from_choices([[1], [0, 0], [0]])
    assert t.parents == (NO_PARENT, 0, 0, 1) and t.ranks == (0, 0, 1, 0)
    buf = build_tree_buffers(t.parents)
    assert buf.depths.tolist() == [0, 1, 1, 2]
    assert buf.mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert buf.paths == [[0, 2], [0, 1, 3]]


def test_branching_config_counts_match_mcsd():
    t = TreeTemplate.from_branching((4, 2, 2, 1))
    assert t.num_nodes - 1 == 4 + 8 + 16 + 16
    buf = build_tree_buffers(t.parents)
    assert len(buf.paths) == 16 and all(len(p) == 5 for p in buf.paths)


def test_level_major_prefix_is_a_valid_subtree_slice():
    t = TreeTemplate.from_branching((3, 2, 2))
    depths = tree_depths(t.parents)
    assert depths == sorted(depths)
    full = build_tree_buffers(t.parents).mask
    for k in (1, 4, 10):
        sub = t.truncate(k)
        assert torch.equal(build_tree_buffers(sub.parents).mask, full[:k, :k])


def test_subtree_keeps_nodes_with_their_parents_renumbered():
    probs = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    tree = TokenTree([5, 10, 11, 12, 13], [NO_PARENT, 0, 1, 0, 3], probs, sources=[0, 0, 0, 1, 1],
                     source_names=("x", "y"))
    sub = tree.subtree([0, 3, 4])
    assert sub.tokens == [5, 12, 13] and sub.parents == [NO_PARENT, 0, 1]
    assert torch.equal(sub.draft_probs, probs[[0, 3, 4]]) and sub.sources == [0, 1, 1]
    assert sub.part_tally([1]) == {"x": (0, 0), "y": (2, 1)}
    # its mask is the kept rows and columns of the full tree's
    assert torch.equal(build_tree_buffers(sub.parents).mask,
                       build_tree_buffers(tree.parents).mask[[0, 3, 4]][:, [0, 3, 4]])


def test_chain_is_lower_triangular():
    tree = TokenTree.chain(7, [1, 2, 3])
    buf = build_tree_buffers(tree.parents)
    assert torch.equal(buf.mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert buf.depths.tolist() == [0, 1, 2, 3] and buf.paths == [[0, 1, 2, 3]]


@pytest.mark.parametrize("bad", [[0], [-1, 1], [-1, 0, 3, 1], []])
def test_malformed_parents_are_rejected(bad):
    with pytest.raises(ValueError):
        validate_parents(bad)


@pytest.mark.skipif(not TREES.is_file(), reason="shared/data/trees.json not beside the project")
def test_published_templates_match_their_recorded_shapes():
    for name, entry in json.loads(TREES.read_text()).items():
        t = TreeTemplate.from_choices(entry["paths"])
        assert t.num_nodes - 1 == entry["num_nodes"], name
        counts = {}
        for d in tree_depths(t.parents)[1:]:
            counts[d] = counts.get(d, 0) + 1
        assert [counts[d] for d in sorted(counts)] == entry["nodes_per_depth"], name


def test_forest_of_target_initialised_roots():
    """MCSD+'s (2, 2, 1): two roots, each with 2 children with 1 child each, level-major."""
    t = TreeTemplate.forest(2, (2, 1))
    assert t.parents == (NO_PARENT, NO_PARENT, 0, 0, 1, 1, 2, 3, 4, 5)
    assert t.ranks == (0, 1, 0, 1, 0, 1, 0, 0, 0, 0)
    assert TreeTemplate.forest(1, (2, 1)) == TreeTemplate.from_branching((2, 1))
    assert TreeTemplate.forest(2, (4, 3, 1, 1)).num_nodes == 2 + 2 * 40   # the paper's 40 drafts per root
    buf = build_tree_buffers(t.parents)
    assert buf.depths.tolist() == [0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert buf.mask[1].nonzero().flatten().tolist() == [1]            # a root sees only itself (and the prefix)
    assert buf.mask[9].nonzero().flatten().tolist() == [1, 5, 9]
    assert buf.paths == [[0, 2, 6], [0, 3, 7], [1, 4, 8], [1, 5, 9]]
    tree = TokenTree([10, 11, 12, 13], [NO_PARENT, NO_PARENT, 0, 1])
    assert tree.num_roots == 2 and tree.num_draft_tokens == 2
    with pytest.raises(ValueError):   # roots must lead
        TokenTree([10, 11, 12], [NO_PARENT, 0, NO_PARENT])


def test_then_hangs_a_tree_from_a_chain_with_both_parts():
    from specserve.engine.tree import TokenTree

    chain = TokenTree.chain(5, [6, 7])
    chain.sources, chain.source_names = [0, 0, 0], ("grammar",)
    after = TokenTree([7, 8, 9, 10], [-1, 0, 0, 1])
    both = chain.then(after, "ngram")
    assert both.tokens == [5, 6, 7, 8, 9, 10] and both.parents == [-1, 0, 1, 2, 2, 3]
    assert both.source_names == ("grammar", "ngram") and both.sources == [0, 0, 0, 1, 1, 1]
    assert both.part_tally([1, 2, 3, 5]) == {"grammar": (2, 2), "ngram": (3, 2)}
    assert both.draft_probs is None
    # sampled drafts after a deterministic chain: the chain's rows are one-hot
    q = torch.softmax(torch.randn(4, 12), -1)
    sampled = chain.then(TokenTree([7, 8, 9, 10], [-1, 0, 0, 1], q), "draft_model")
    assert sampled.draft_probs.shape == (6, 12) and torch.equal(sampled.draft_probs[3:], q[1:])
    assert sampled.draft_probs[1, 6] == 1 and sampled.draft_probs[2, 7] == 1 and sampled.draft_probs[1].sum() == 1
    with pytest.raises(ValueError):
        chain.then(TokenTree([6, 8], [-1, 0]), "ngram")          # not rooted at the chain's last token
    with pytest.raises(ValueError):
        after.then(TokenTree([10, 11], [-1, 0]), "ngram")        # not a chain

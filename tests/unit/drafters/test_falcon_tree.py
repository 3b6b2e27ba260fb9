"""The falcon drafter's relaxed causal mask and its custom decoding tree, against hand-worked
examples: blocks of k rows (bidirectional inside, causal across, the whole prefix visible), trees
Cartesian within a k-block and conditional across blocks, deduplicated, cut to the budget along a
preference order; and the tree the serving drafter builds (paged KV, catch-up, one forward per
block level) against the same tree computed with the training forward."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import draft_view

from specserve.drafters.base import DrafterContext, make_drafter
from specserve.drafters.falcon import (SarPlan, chain_tree, closed_paths, dedup_paths, empirical_probability,
                                       is_prefix_closed, load_tree, order_within, topk_tree)
from specserve.drafters.nets.falcon import FalconHead, block_ids, relaxed_causal_mask, root_block_mask
from specserve.drafters.train.target import target_features
from specserve.engine.features import FeatureStore
from specserve.engine.kv_cache import PagedDraftKV
from specserve.engine.model import rope_tables
from specserve.engine.tree import NO_PARENT, tree_depths


def _tiny(model_dir):
    from specserve.drafters.train.pipeline import prepare_target

    t = prepare_target(str(model_dir), device="cpu", dtype="float32", max_positions=256)
    return t.model_config, t.model



# ---- the relaxed causal mask -------------------------------------------------------------------------------------

def test_relaxed_causal_mask_hand_worked():
    assert relaxed_causal_mask(5, 2).int().tolist() == [[1, 1, 0, 0, 0],
                                                        [1, 1, 0, 0, 0],
                                                        [1, 1, 1, 1, 0],
                                                        [1, 1, 1, 1, 0],
                                                        [1, 1, 1, 1, 1]]
    # blocks starting at odd rows: {0} {1,2} {3,4}; two prefix rows all visible
    assert relaxed_causal_mask(5, 2, offset=1, prefix=2).int().tolist() == [[1, 1, 1, 0, 0, 0, 0],
                                                                           [1, 1, 1, 1, 1, 0, 0],
                                                                           [1, 1, 1, 1, 1, 0, 0],
                                                                           [1, 1, 1, 1, 1, 1, 1],
                                                                           [1, 1, 1, 1, 1, 1, 1]]
    assert block_ids(7, 3, offset=1).tolist() == [-1, 0, 0, 0, 1, 1, 1]
    assert torch.equal(relaxed_causal_mask(6, 1), torch.ones(6, 6, dtype=torch.bool).tril())   # k = 1: causal
    # serving catch-up: causal rows, then the root block (the last k rows) sees the whole chunk
    assert root_block_mask(4, 2).int().tolist() == [[1, 0, 0, 0],
                                                    [1, 1, 0, 0],
                                                    [1, 1, 1, 1],
                                                    [1, 1, 1, 1]]
    assert root_block_mask(2, 2).all() and root_block_mask(1, 2).all()


def test_dense_forward_uses_the_relaxed_mask(tiny_llama_dir):
    """A row's output changes with its block mate's input and not with a later block's."""
    cfg, model = _tiny(tiny_llama_dir)
    head = FalconHead.from_target(cfg, model, init="random", seed=1).eval()
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1, 6, cfg.hidden_size, generator=g)
    e = model.embed(torch.randint(3, 300, (1, 6), generator=g)).detach()
    cos, sin = rope_tables(cfg, 8, torch.device("cpu"))
    with torch.no_grad():
        base = head.forward_dense(f, e, cos[:6], sin[:6])
        f2 = f.clone()
        f2[0, 3] += 1.0                                       # row 3: block {2, 3}
        moved = head.forward_dense(f2, e, cos[:6], sin[:6])
    changed = [(moved[0, r] - base[0, r]).abs().max().item() > 1e-5 for r in range(6)]
    assert changed == [False, False, True, True, True, True]


# ---- the tree ----------------------------------------------------------------------------------------------------

def test_plan_is_cartesian_within_a_block_and_conditional_across():
    """The SarPlan docstring's example, by hand: nodes (level-major) 1=[0] 2=[1] 3=[0,0] 4=[0,1]
    5=[1,0] 6=[0,0,0] 7=[0,1,0] 8=[0,0,0,0] 9=[0,0,1]."""
    paths = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [1, 0], [0, 1, 0], [0, 0, 0, 0], [0, 0, 1]]
    plan = SarPlan.build(paths, 2)
    assert plan.template.parents == (NO_PARENT, 0, 0, 1, 1, 2, 3, 3, 4, 6)
    assert plan.template.ranks == (0, 0, 1, 0, 1, 0, 0, 1, 0, 0)
    # depths 1-2 from the root block (rows 0 and 1): [0,0] and [1,0] read the same row and rank
    assert plan.node_exp[1:6] == (0, 0, 0, 0, 0) and plan.node_row[1:6] == (0, 0, 1, 1, 1)
    # depths 3-4 from the expansion of their depth-2 ancestor: [0,0] -> exp 1, [0,1] -> exp 2
    assert plan.node_exp[6:] == (1, 1, 2, 1) and plan.node_row[6:] == (0, 0, 0, 1)
    e1, e2 = plan.expansions[1], plan.expansions[2]
    assert (e1.node, e1.parent, e1.input_nodes, e1.row, e1.level) == (3, 0, (1, 3), 0, 1)
    assert (e2.node, e2.parent, e2.input_nodes, e2.row, e2.level) == (4, 0, (1, 4), 2, 1)
    assert plan.need == ((2, 2), (2, 1), (1, 0))             # top-r read at each row of each block
    assert plan.num_tree_rows == 4 and plan.num_levels == 2
    assert plan.visible_rows(2) == [2, 3]
    # a third block: [0,0,0,0] expands, seeing exp 1's rows and its own
    deep = SarPlan.build(paths + [[0, 0, 0, 0, 0]], 2)
    e3 = deep.expansions[3]
    assert (e3.node, e3.parent, e3.ancestors, e3.level) == (9, 1, (1,), 2)
    assert deep.visible_rows(3) == [0, 1, 4, 5] and deep.num_levels == 3


def test_order_within_and_the_budget_cut():
    tree = [[0], [1], [0, 0], [1, 0], [0, 1], [0, 0, 0]]
    probs = {(0,): 0.6, (1,): 0.2, (0, 0): 0.4, (1, 0): 0.15, (0, 1): 0.1, (0, 0, 0): 0.3}
    order = order_within(tree, lambda p: probs[tuple(p)])
    assert order == [[0], [0, 0], [0, 0, 0], [1], [1, 0], [0, 1]]
    assert all(is_prefix_closed(order[:n]) for n in range(1, 7))
    assert not is_prefix_closed([[0, 0], [0]])
    # empirical path probabilities: the fraction of positions whose rank prefix is the path
    ranks = torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, -1]])
    prob = empirical_probability(ranks)
    assert (prob([0]), prob([0, 0]), prob([0, 0, 1]), prob([1, 0]), prob([2])) == (0.75, 0.5, 0.25, 0.25, 0.0)
    assert dedup_paths([[0], [0, 1], [0], [0, 1, 0, 0], [0, 1, 0, 0]]) == [[0], [0, 1], [0, 1, 0, 0]]
    assert closed_paths([[0, 1, 0]]) == [[0], [0, 1], [0, 1, 0]]
    assert topk_tree(2, 2) == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]] and chain_tree(3) == [[0], [0, 0], [0, 0, 0]]


def test_shared_falcon_trees_are_deduplicated(tmp_path, monkeypatch):
    """The trees.json duplicates are dropped: a folder whose tree lists [0, 1, 0, 0] twice gives
    one node for it, and the drafter's budget cuts are prefixes of one preference order."""
    paths = [[0], [1], [0, 0], [0, 1], [0, 1, 0], [0, 1, 0, 0], [0, 0, 0], [0, 1, 0, 0], [1, 0]]
    (tmp_path / "trees.json").write_text(json.dumps({"falcon_kmask2_8layer_tree": {"paths": paths}}))
    monkeypatch.setenv("SPECSERVE_DATA", str(tmp_path))
    assert load_tree("falcon_kmask2_8layer_tree") == dedup_paths(paths) and len(dedup_paths(paths)) == 8
    assert load_tree("falcon_kmask2_4layer_tree") is None


def test_the_papers_trees_from_the_shared_data():
    t8, t4 = load_tree("falcon_kmask2_8layer_tree"), load_tree("falcon_kmask2_4layer_tree")
    if t8 is None or t4 is None:
        pytest.skip("the shared data folder's trees.json is not there")
    assert len(t8) == 165 and len({tuple(p) for p in t8}) == 165
    assert [sum(len(p) == d for p in t8) for d in range(1, 9)] == [20, 15, 19, 23, 21, 23, 21, 23]
    assert len(t4) == 75
    plan = SarPlan.build(t8, 2)
    assert plan.num_nodes == 166 and plan.num_levels == 4     # four drafter forwards, the root block's included


def test_drafter_tree_cuts_fit_the_budget(tiny_llama_dir):
    cfg, model = _tiny(tiny_llama_dir)
    drafter = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                           max_model_len=64, random_init=True, tree="falcon_kmask2_4layer_tree")
    if drafter.tree_name != "falcon_kmask2_4layer_tree":
        pytest.skip("the shared data folder's trees.json is not there")
    full = {tuple(p) for p in load_tree("falcon_kmask2_4layer_tree")}
    assert len(drafter.order) == 75 and {tuple(p) for p in drafter.order} == full
    for budget in (1, 3, 8, 20, 74, 75, 200):
        plan = drafter.plan(budget)
        assert plan.num_nodes - 1 == min(budget, 75)
        depths = tree_depths(plan.template.parents)
        assert depths == sorted(depths)                        # level-major
    plain = make_drafter("falcon", target=model, model_config=cfg, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64, random_init=True, tree="topk", top_k=2, depth=4)
    assert plain.plan(8).template.parents == (NO_PARENT, 0, 0, 1, 1, 2, 2, 3, 3)   # level-major, 2 children each


def test_options_are_declared_keywords(tiny_llama_dir):
    import inspect

    from specserve.drafters.base import DrafterOptionError
    from specserve.drafters.falcon import FalconDrafter

    params = list(inspect.signature(FalconDrafter).parameters.values())
    assert params[0].name == "ctx" and not any(p.kind is p.VAR_KEYWORD for p in params)
    cfg, model = _tiny(tiny_llama_dir)
    with pytest.raises(DrafterOptionError, match=r"'dept' \(did you mean 'depth'\?\)"):
        make_drafter("falcon", DrafterContext(target=model, model_config=cfg, max_model_len=64), random_init=True,
                     dept=3)


# ---- the served tree is the training forward's ------------------------------------------------------------------

def dense_tree_tokens(head: FalconHead, model, prefix: list[int], paths: list[list[int]],
                      forced: dict[tuple[int, ...], int] | None = None) -> dict:
    """The token of every path computed with the training forward (`forward_dense`, relaxed mask
    aligned so that the root block is the last k real rows), block by block along each path; the
    paths in `forced` carry the token given there instead."""
    forced, prefix = forced or {}, list(prefix)
    k = head.k
    n = len(prefix)
    real = target_features(model, [prefix[:-1]])[0]                       # f_0 .. f_{N-2}
    cos, sin = rope_tables(model.cfg, n + 16, torch.device("cpu"))
    offset = (n - 1 - k) % k

    def block_out(feats_extra: list[torch.Tensor], toks_extra: list[int]) -> torch.Tensor:
        f = torch.cat([real, *feats_extra]) if feats_extra else real
        x = prefix[1:] + toks_extra
        with torch.no_grad():
            out = head.forward_dense(f[None], model.embed(torch.tensor([x])), cos[:len(x)], sin[:len(x)],
                                     offsets=offset)[0]
        return out[-k:]

    outs = {(): block_out([], [])}                                         # block path (tokens) -> [k, H] outputs
    chains: dict[tuple, list] = {(): [[], []]}
    tokens: dict[tuple[int, ...], int] = {}
    for path in closed_paths(paths):
        d = len(path)
        level, row = (d - 1) // k, (d - 1) % k
        anchor = tuple(tokens[tuple(path[:j])] for j in range(1, level * k + 1))
        if anchor not in outs:
            prev = anchor[:-k]
            feats, toks = chains[prev]
            feats, toks = feats + [outs[prev]], toks + list(anchor[-k:])
            chains[anchor] = [feats, toks]
            outs[anchor] = block_out(feats, toks)
        with torch.no_grad():
            logits = model.compute_logits(outs[anchor][row:row + 1])[0]
        tokens[tuple(path)] = forced.get(tuple(path), int(logits.topk(path[-1] + 1).indices[-1]))
    return tokens


@pytest.mark.parametrize("prefix_len", [9, 10])   # both parities of the root block's position
@pytest.mark.parametrize("source", ["observe", "store"])
def test_served_tree_is_the_training_forwards_tree(tiny_llama_dir, prefix_len, source):
    """`observe`: built outside an engine, the drafter keeps the features `observe` hands it;
    `store`: it reads them from the engine's feature store, which the engine writes before telling
    the drafter the positions (the hidden states handed to `observe` are then not read: zeros here)."""
    cfg, model = _tiny(tiny_llama_dir)
    head = FalconHead.from_target(cfg, model, init="random", seed=3).eval()
    paths = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0],
             [0, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 0]]
    store = FeatureStore(cfg.hidden_size, torch.float32) if source == "store" else None
    drafter = make_drafter("falcon", DrafterContext(target=model, model_config=cfg, max_model_len=64, features=store),
                           head=head, tree=json.dumps(paths), block_size=4)
    assert isinstance(drafter.kv, PagedDraftKV) and (store is None or drafter.features is store)

    def deliver(start: int, hidden: torch.Tensor) -> None:
        if store is not None:
            store.write(seq.seq_id, start, hidden)
            hidden = torch.zeros_like(hidden)
        drafter.observe([seq], [(start, hidden)])

    g = torch.Generator().manual_seed(prefix_len)
    prefix = torch.randint(3, cfg.vocab_size, (prefix_len,), generator=g).tolist()
    seq = draft_view(0, prefix)
    drafter.start(seq)
    # features in two deliveries (a prefill in chunks), then one more token: the root block moves
    deliver(0, target_features(model, [prefix[:4]])[0])
    deliver(4, target_features(model, [prefix[:-1]])[0][4:])
    tree = drafter.propose([seq], [len(paths)])[0]
    want = dense_tree_tokens(head, model, prefix, paths)
    plan = drafter.plan(len(paths))
    got = {}
    for i in range(1, tree.num_nodes):
        path, j = [], i
        while j:
            path.append(plan.template.ranks[j])
            j = tree.parents[j]
        got[tuple(reversed(path))] = tree.tokens[i]
    assert got == want
    assert got[(0, 0)] == got[(1, 0)]                        # Cartesian within the root block
    drafter.accept([seq], [None])
    assert drafter.blocks.block_tables[0] and drafter.state[0].kv_len == prefix_len - 1
    # the bonus of a step that accepted nothing: one new real row, the root block is rows N-3, N-2
    seq = draft_view(0, [*prefix, int(torch.randint(3, cfg.vocab_size, (1,), generator=g))])
    deliver(prefix_len - 1, target_features(model, [seq.token_ids[:-1]])[0][-1:])
    tree = drafter.propose([seq], [len(paths)])[0]
    want = dense_tree_tokens(head, model, seq.token_ids, paths)
    assert [tree.tokens[i] for i in range(1, tree.num_nodes)] == \
           [want[tuple(p)] for p in closed_paths(paths)]      # level-major, ranks ascending = closed_paths order
    drafter.accept([seq], [None])
    # features again from position 0 (a recomputation, here of a prefix that differs in its first
    # token): every row is redone, none of the old ones is read
    seq = draft_view(0, [3 + (seq.token_ids[0] - 2) % (cfg.vocab_size - 3), *seq.token_ids[1:]])
    deliver(0, target_features(model, [seq.token_ids[:-1]])[0])
    assert drafter.state[0].kv_len == 0
    tree = drafter.propose([seq], [len(paths)])[0]
    want = dense_tree_tokens(head, model, seq.token_ids, paths)
    assert [tree.tokens[i] for i in range(1, tree.num_nodes)] == [want[tuple(p)] for p in closed_paths(paths)]
    drafter.finish(seq)
    assert not drafter.state and drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


@pytest.mark.parametrize("num_hypothetical", [1, 2, 3])   # inside the root block, at its end, past it (k = 2)
def test_the_tree_after_hypothetical_tokens_is_the_training_forwards_tree(tiny_llama_dir, num_hypothetical):
    """After h hypothetical tokens (a grammar's forced ones) the tree is the one the training forward
    gives for the paths under a chain of h rank-0 nodes carrying those tokens: the root block's
    distributions for the depths after them, expansions reading them; returned under the last one,
    and nothing of it kept (the committed prefix drafts its old tree again)."""
    cfg, model = _tiny(tiny_llama_dir)
    head = FalconHead.from_target(cfg, model, k=2, init="random", seed=4)
    paths = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0, 0]]
    drafter = make_drafter("falcon", DrafterContext(target=model, model_config=cfg, max_model_len=64),
                           head=head, tree=json.dumps(paths), block_size=4)
    g = torch.Generator().manual_seed(num_hypothetical)
    prefix = torch.randint(3, cfg.vocab_size, (11,), generator=g).tolist()
    hyp = torch.randint(3, cfg.vocab_size, (num_hypothetical,), generator=g).tolist()
    seq = draft_view(0, prefix)
    drafter.start(seq)
    drafter.observe([seq], [(0, target_features(model, [prefix[:-1]])[0])])
    before = drafter.propose([seq], [len(paths)])[0]
    drafter.accept([seq], [None])
    tree = drafter.propose([seq.extend(hyp)], [len(paths)])[0]
    h = num_hypothetical
    chain = {(0,) * d: hyp[d - 1] for d in range(1, h + 1)}
    want = dense_tree_tokens(head, model, prefix, [list(p) for p in chain] + [[0] * h + p for p in paths], chain)
    plan = drafter.plan(len(paths), h)
    assert tree.tokens[0] == hyp[-1] and tree.num_nodes == len(paths) + 1
    for i in range(1, tree.num_nodes):
        j, path = i + h, []
        while j:
            path.append(plan.template.ranks[j])
            j = plan.template.parents[j]
        assert tree.tokens[i] == want[tuple(reversed(path))], i
    assert tree_depths(tree.parents)[1:] == [len(p) for p in closed_paths(paths)]
    assert drafter.state[0].kv_len == len(prefix) - 1
    assert drafter.propose([seq], [len(paths)])[0].tokens == before.tokens

"""Batched device verification: `pack_trees` against `build_tree_buffers`, greedy batched verification
equal to the Python reference walk (exactly, ties included), the sampling walk lossless on the joint
law of two tokens (with the broken-residual controls failing), forests and next-root candidates,
seeded reproducibility whatever the batch, keyed trees committing exactly the tokens keyed plain
sampling draws along their path, and no host sync inside the batched functions."""

from __future__ import annotations

import contextlib
import random
from collections import OrderedDict

import pytest
import torch
from helpers import DEVICES, random_tree

from specserve.engine import tree as tree_mod
from specserve.engine import verify
from specserve.engine.sampler import SamplingTensors, sample, sample_key
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import (NO_PARENT, TokenTree, TreeTemplate, build_tree_buffers, pack_trees,
                                   tree_topology)
from specserve.engine.verify import (PAD_TOKEN, to_verify_results, verify_batched, verify_greedy,
                                     verify_greedy_batched, verify_results_from_stacked, verify_sampling,
                                     verify_sampling_batched)

V = 6


def host_results(res: verify.BatchVerifyResult) -> list[verify.VerifyResult]:
    return to_verify_results(res.path.tolist(), res.num_accepted.tolist(), res.tokens.tolist(),
                             res.root.tolist(), res.alternates.tolist())


# --- pack_trees ------------------------------------------------------------------------------------

def test_pack_trees_matches_build_tree_buffers_and_pads():
    trees = [TokenTree([5, 1, 2, 3], [NO_PARENT, 0, 0, 1]),
             TokenTree([7, 8, 9, 4, 4], [NO_PARENT, NO_PARENT, 0, 1, 1], next_roots=3),
             TokenTree.root_only(4),
             TokenTree.chain(1, [2, 3, 4, 5, 6])]
    p = pack_trees(trees)
    N = 6
    assert p.tokens.shape == (4, N) and p.sizes == [4, 5, 1, 6] and p.num_nodes.tolist() == [4, 5, 1, 6]
    assert p.num_roots.tolist() == [1, 2, 1, 1] and p.max_roots == 2 and p.max_depth == 5
    assert p.next_roots.tolist() == [1, 3, 1, 1] and p.max_next_roots == 3
    assert p.draft_probs is None and p.stochastic.tolist() == [False] * 4
    assert p.children.shape == (4, N, 2)
    for t, tr in enumerate(trees):
        n = tr.num_nodes
        buf = build_tree_buffers(tr.parents)
        assert torch.equal(p.mask[t, :n, :n], buf.mask)
        assert torch.equal(p.depths[t, :n], buf.depths)
        assert p.tokens[t, :n].tolist() == tr.tokens and p.tokens[t, n:].tolist() == [0] * (N - n)
        assert p.parents[t, :n].tolist() == tr.parents and p.parents[t, n:].tolist() == [NO_PARENT] * (N - n)
        assert torch.equal(p.mask[t, n:], torch.eye(N, dtype=torch.bool)[n:])      # padding: self only
        assert not p.mask[t, :n, n:].any()
        for i in range(N):
            kids = [c for c in range(n) if tr.parents[c] == i] if i < n else []
            assert p.children[t, i].tolist() == kids + [-1] * (2 - len(kids))


def test_pack_trees_draft_probs_and_stochastic_flag():
    dp = torch.softmax(torch.randn(3, V), 1)
    trees = [TokenTree([0, 1, 2], [NO_PARENT, 0, 0], dp), TokenTree([3, 4], [NO_PARENT, 0])]
    p = pack_trees(trees)
    assert p.stochastic.tolist() == [True, False]
    assert p.draft_probs.shape == (2, 3, V)
    assert torch.equal(p.draft_probs[0], dp) and not p.draft_probs[1].any()


def test_topology_cache_builds_each_shape_once(monkeypatch):
    parents = TreeTemplate.from_branching((3, 2, 1, 1)).parents
    first = tree_topology(parents)
    monkeypatch.setattr(tree_mod, "_build_topology", lambda p: pytest.fail("rebuilt a cached topology"))
    assert tree_topology(list(parents)) is first
    pack_trees([TokenTree(list(range(len(parents))), list(parents))] * 3)   # cached: no rebuild


def test_topology_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(tree_mod, "TOPOLOGY_CACHE_SIZE", 4)
    monkeypatch.setattr(tree_mod, "_TOPOLOGY_CACHE", OrderedDict())   # whatever earlier tests cached
    for n in range(2, 12):
        tree_topology([NO_PARENT] + list(range(n - 1)))
    assert len(tree_mod._TOPOLOGY_CACHE) <= 4


# --- greedy ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_greedy_batched_equals_the_reference_on_random_batches(device):
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for _ in range(250):
        vocab = rng.choice([2, 3, 5])
        trees = [random_tree(rng, vocab) for _ in range(rng.randint(1, 9))]
        packed = pack_trees(trees, device)
        argmax = torch.randint(0, vocab, packed.tokens.shape, generator=g).to(device)
        if rng.random() < 0.2:   # the drafts are exactly the target's argmax: long walks, many ties
            argmax = torch.where(packed.parents[:, :, None] == torch.arange(packed.max_nodes, device=device),
                                 packed.tokens[:, None, :], -1).amax(dim=2).clamp_min(0)
        res = verify_greedy_batched(packed, argmax)
        got = host_results(res)
        D = packed.max_depth
        assert res.path.shape == res.tokens.shape == (len(trees), D + 1)
        for t, tr in enumerate(trees):
            ref = verify_greedy(tr.tokens, tr.parents, argmax[t, :tr.num_nodes].tolist())
            assert got[t] == ref, (tr, argmax[t])
            n = len(ref.accepted_nodes)
            assert res.path[t, :n + 1].tolist() == [ref.root] + ref.accepted_nodes
            assert res.path[t, n + 1:].tolist() == [-1] * (D - n)
            assert res.tokens[t, n + 1:].tolist() == [PAD_TOKEN] * (D - n)


def test_greedy_batched_hand_worked_ties_and_nothing_accepted():
    # duplicate sibling tokens: the first (node 1) is taken, though node 2's subtree is deeper
    a = TokenTree([9, 3, 3, 4, 5], [NO_PARENT, 0, 0, 2, 3])
    # forest: both roots accept one draft -> the first root wins
    b = TokenTree([9, 8, 3, 4], [NO_PARENT, NO_PARENT, 0, 1])
    # nothing matches
    c = TokenTree([1, 2, 2], [NO_PARENT, 0, 1])
    packed = pack_trees([a, b, c])
    argmax = torch.tensor([[3, 0, 4, 5, 6], [3, 4, 1, 2, 0], [0, 0, 0, 0, 0]])
    got = host_results(verify_greedy_batched(packed, argmax))
    assert (got[0].accepted_nodes, got[0].tokens) == ([1], [3, 0])
    assert (got[1].root, got[1].accepted_nodes, got[1].tokens) == (0, [2], [3, 1])
    assert (got[2].accepted_nodes, got[2].tokens) == ([], [0])


def test_stacked_single_transfer_round_trip():
    rng = random.Random(3)
    trees = [random_tree(rng, 3) for _ in range(6)]
    packed = pack_trees(trees)
    res = verify_greedy_batched(packed, torch.randint(0, 3, packed.tokens.shape))
    assert verify_results_from_stacked(res.stacked().tolist(), packed.max_depth) == host_results(res)


# --- sampling: equivalences ------------------------------------------------------------------------

def test_sampling_batched_on_one_hot_targets_is_the_greedy_walk():
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    for _ in range(120):
        vocab = rng.choice([2, 3, 5])
        trees = [random_tree(rng, vocab) for _ in range(rng.randint(1, 8))]
        packed = pack_trees(trees)
        argmax = torch.randint(0, vocab, packed.tokens.shape, generator=g)
        res = verify_sampling_batched(packed, torch.nn.functional.one_hot(argmax, vocab).float())
        for t, (tr, r) in enumerate(zip(trees, host_results(res))):
            assert r == verify_greedy(tr.tokens, tr.parents, argmax[t, :tr.num_nodes].tolist())


def test_forest_keeps_the_longest_walk_like_the_reference():
    tokens, parents = [9, 8, 3, 4, 5], [NO_PARENT, NO_PARENT, 0, 1, 3]
    one_hot = torch.eye(V)
    probs = torch.stack([one_hot[3], one_hot[4], one_hot[1], one_hot[5], one_hot[2]])
    ref = verify_sampling(tokens, parents, probs, None, torch.Generator().manual_seed(0))
    packed = pack_trees([TokenTree(tokens, parents), TokenTree.chain(0, [1])])
    tp = torch.zeros(2, 5, V)
    tp[0], tp[1, :2] = probs, one_hot[[1, 2]]
    got = host_results(verify_sampling_batched(packed, tp))
    assert (got[0].root, got[0].accepted_nodes, got[0].bonus_token) == (ref.root, ref.accepted_nodes, ref.bonus_token) == (1, [3, 4], 2)
    assert got[1].tokens == [1, 2]


def test_perfect_drafter_accepts_everything():
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(4, V, generator=g), 1)
    q = p.roll(1, 0)   # node i was drawn from the target distribution at its parent
    trees = [TokenTree([0, 1, 2, 3], [NO_PARENT, 0, 1, 2], q) for _ in range(8)]
    res = verify_sampling_batched(pack_trees(trees), p.expand(8, 4, V).contiguous())
    assert res.num_accepted.tolist() == [3] * 8 and res.path[:, 1:].tolist() == [[1, 2, 3]] * 8


def test_candidates_for_the_next_roots_are_distinct_and_the_first_is_exact():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0, 0.0])
    B, calls = 200, 100
    trees = [TokenTree([0], [NO_PARENT], next_roots=3) for _ in range(B - 1)] + [TokenTree.root_only(0)]
    packed = pack_trees(trees)
    assert packed.max_next_roots == 3
    torch.manual_seed(5)
    firsts = torch.zeros(V)
    for _ in range(calls):
        res = verify_sampling_batched(packed, p.expand(B, 1, V).contiguous())
        assert res.alternates.shape == (B, 2)
        assert (res.alternates[-1] == -1).all()              # the W = 1 tree gets no alternates
        drawn = torch.cat([res.tokens[:-1, :1], res.alternates[:-1]], dim=1)
        assert (p[drawn] > 0).all()
        s = drawn.sort(dim=1).values
        assert (s[:, 1:] != s[:, :-1]).all()                 # distinct
        firsts += torch.bincount(res.tokens[:, 0], minlength=V)
    assert (firsts / (B * calls) - p).abs().sum() / 2 < 0.015
    # less support than W: fewer candidates, padded with -1
    one = torch.tensor([0.0, 1.0, 0, 0, 0, 0])
    res = verify_sampling_batched(pack_trees([TokenTree([0], [NO_PARENT], next_roots=3)]), one[None, None])
    assert host_results(res)[0].tokens == [1] and host_results(res)[0].alternates == []
    assert res.alternates.tolist() == [[-1, -1]]


def test_no_tree_asks_for_alternates_gives_an_empty_column():
    packed = pack_trees([TokenTree.chain(0, [1, 2])])
    assert verify_sampling_batched(packed, torch.full((1, 3, V), 1.0 / V)).alternates.shape == (1, 0)


# --- sampling: lossless ----------------------------------------------------------------------------

def draw_without_replacement(q: torch.Tensor, k: int, g: torch.Generator) -> torch.Tensor:
    """[B, V] distributions -> [B, k] sequential draws without replacement (Gumbel top-k)."""
    gumbel = -torch.empty_like(q).exponential_(generator=g).log()
    return (q.log() + gumbel).topk(k, dim=-1).indices


def joint_two_tokens(trials: int, deterministic: bool, seed: int = 0, batch: int = 64,
                     device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """tests/unit/engine/test_verify.py's joint law of the first two committed tokens, through
    `verify_sampling_batched`: each trial is one tree of a batch (root with 3 children, each with
    2 children; p1 at the root, p2[t1] after t1; a one-token commit is continued by plain sampling
    from p2[t1]). Half the trees of a batch draw from their own generator, half from the global RNG.
    The drafts are drawn on the host; trees, target probabilities, draft distributions and the
    verification's generators live on `device`."""
    g = torch.Generator().manual_seed(seed)
    p1 = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    p2 = torch.softmax(torch.randn(V, V, generator=g) * 1.5, 1)
    q1 = torch.softmax(torch.randn(V, generator=g), 0)               # drafter, deliberately off
    q2 = torch.softmax(torch.randn(V, V, generator=g), 1)
    torch.manual_seed(seed)
    gens = [torch.Generator(device).manual_seed(1000 * seed + i) if i % 2 else None for i in range(batch)]
    parents = [NO_PARENT, 0, 1, 1, 0, 4, 4, 0, 7, 7]
    kid_nodes, gk_nodes = [1, 4, 7], [[2, 3], [5, 6], [8, 9]]
    counts = torch.zeros(V, V)
    done = 0
    while done < trials:
        B = min(batch, trials - done)
        if deterministic:
            kids = torch.tensor([0, 2, 5]).expand(B, 3)
            gks = torch.stack([(kids + 1) % V, (kids + 3) % V], dim=2)               # [B, 3, 2]
        else:
            kids = draw_without_replacement(q1.expand(B, V), 3, g)                   # [B, 3]
            gks = draw_without_replacement(q2[kids].reshape(B * 3, V), 2, g).view(B, 3, 2)
        tok = torch.full((B, 10), 99)
        probs = torch.full((B, 10, V), 1.0 / V)
        draft = torch.zeros(B, 10, V)
        probs[:, 0] = p1
        for j, node in enumerate(kid_nodes):
            tok[:, node] = kids[:, j]
            probs[:, node] = p2[kids[:, j]]
            draft[:, node] = q1
            for m, gnode in enumerate(gk_nodes[j]):
                tok[:, gnode] = gks[:, j, m]
                draft[:, gnode] = q2[kids[:, j]]
        trees = [TokenTree(tok[b].tolist(), parents, None if deterministic else draft[b].to(device)) for b in range(B)]
        res = verify_sampling_batched(pack_trees(trees, device), probs.to(device), gens[:B])
        first, second = res.tokens[:, 0].cpu(), res.tokens[:, 1].cpu()
        plain = torch.multinomial(p2[first], 1, generator=g).squeeze(1)
        second = torch.where(res.num_accepted.cpu() == 0, plain, second)
        counts += torch.bincount(first * V + second, minlength=V * V).view(V, V).float()
        done += B
    return counts / trials, p1[:, None] * p2


TV_BOUND = 0.035   # sampling noise of 12k trials on 36 outcomes is ~0.02


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_sampling_batched_is_lossless(deterministic, device):
    emp, exact = joint_two_tokens(12_000, deterministic=deterministic, seed=int(deterministic), device=device)
    assert (emp - exact).abs().sum() / 2 < TV_BOUND


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("broken", ["no_residual_update", "residual_without_clamp"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_the_statistical_test_catches_a_wrong_residual_update(monkeypatch, broken, deterministic, device):
    """The same test with a deliberately wrong residual rule must fail: it has the power to see it."""
    def without_clamp(p, q):
        r = (p - 0.5 * q).abs()
        return r / r.sum(dim=-1, keepdim=True)
    wrong = {"no_residual_update": lambda p, q: p, "residual_without_clamp": without_clamp}[broken]
    monkeypatch.setattr(verify, "residual_rows", wrong)
    emp, exact = joint_two_tokens(12_000, deterministic=deterministic, seed=int(deterministic), device=device)
    assert (emp - exact).abs().sum() / 2 > TV_BOUND


# --- verify_batched, reproducibility, no host sync -------------------------------------------------

def mixed_batch(rng: random.Random, T: int, vocab: int, max_nodes: int = 14):
    trees = []
    for t in range(T):
        tr = random_tree(rng, vocab, max_nodes)
        if t % 3 == 1:
            tr = TokenTree(tr.tokens, tr.parents, torch.softmax(torch.randn(tr.num_nodes, vocab), 1))
        if t % 4 == 2:
            tr.next_roots = 2
        trees.append(tr)
    return trees


def favour_drafts(logits: torch.Tensor, trees: list[TokenTree], rng: random.Random, chance: float) -> torch.Tensor:
    """`logits` [T, N, V] with each drafted token raised by 3 at its parent, with probability
    `chance` per node: a target that often likes the drafts, so walks go deeper."""
    for t, tr in enumerate(trees):
        for i, par in enumerate(tr.parents):
            if par != NO_PARENT and rng.random() < chance:
                logits[t, par, tr.tokens[i]] += 3
    return logits


def test_verify_batched_greedy_rows_equal_the_reference_and_random_rows_are_valid():
    rng = random.Random(7)
    vocab = 5
    for _ in range(30):
        T = rng.randint(1, 8)
        trees = mixed_batch(rng, T, vocab)
        packed = pack_trees(trees)
        logits = torch.randn(T, packed.max_nodes, vocab)
        params = [SamplingParams(temperature=0.0) if t % 2 == 0 else SamplingParams(temperature=0.8, top_k=3, top_p=0.9)
                  for t in range(T)]
        st = SamplingTensors.from_params(params, "cpu")
        res = verify_batched(packed, logits, st, [None] * T)
        for t, (tr, r) in enumerate(zip(trees, host_results(res))):
            if t % 2 == 0:
                assert r == verify_greedy(tr.tokens, tr.parents, logits[t, :tr.num_nodes].argmax(-1).tolist())
            else:
                # a valid walk: root then a chain of children, tokens = their tokens
                path = [r.root] + r.accepted_nodes
                assert all(tr.parents[b] == a for a, b in zip(path, path[1:]))
                assert r.accepted_tokens == [tr.tokens[i] for i in r.accepted_nodes]
                assert r.bonus_token in logits[t, path[-1]].topk(3).indices.tolist()   # top-k = 3
        # all greedy: the greedy path alone
        st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * T, "cpu")
        res = verify_batched(packed, logits, st)
        for t, (tr, r) in enumerate(zip(trees, host_results(res))):
            assert r == verify_greedy(tr.tokens, tr.parents, logits[t, :tr.num_nodes].argmax(-1).tolist())


def test_seeded_trees_reproduce_whatever_the_batch():
    vocab = 7
    mine = TokenTree([0, 1, 2, 3, 4, 5], [NO_PARENT, 0, 0, 1, 1, 2], torch.softmax(torch.randn(6, vocab), 1))
    logits_mine = torch.randn(6, vocab)
    rng = random.Random(11)
    outcomes = []
    for trial in range(6):
        others = mixed_batch(rng, rng.randint(0, 6), vocab)
        pos = rng.randint(0, len(others))
        trees = others[:pos] + [mine] + others[pos:]
        packed = pack_trees(trees)
        logits = torch.randn(len(trees), packed.max_nodes, vocab)
        logits[pos, :6] = logits_mine
        gens = [torch.Generator().manual_seed(99) if t == pos else
                (torch.Generator().manual_seed(trial * 10 + t) if t % 2 else None) for t in range(len(trees))]
        st = SamplingTensors.from_params([SamplingParams(temperature=0.9)] * len(trees), "cpu")
        rows = []
        for _ in range(3):   # three steps with the same generator: the whole stream reproduces
            res = verify_batched(packed, logits, st, gens)
            rows.append(host_results(res)[pos])
        outcomes.append(rows)
    assert all(o == outcomes[0] for o in outcomes)


def test_keyed_trees_commit_what_keyed_plain_sampling_draws_along_the_path():
    """A keyed (seeded) tree commits, token for token, what plain sampling with the same key draws
    at those output positions from the logits along the accepted path — and the walk is the greedy
    walk on the keyed samples of every node. Mixed with greedy and unkeyed random trees."""
    rng = random.Random(3)
    torch.manual_seed(3)
    vocab = 6
    accepted = 0
    for trial in range(25):
        T = rng.randint(1, 7)
        trees = [tr if tr.num_roots == 1 else TokenTree.chain(tr.tokens[0], tr.tokens[1:3])
                 for tr in mixed_batch(rng, T, vocab)]
        for tr in trees:
            tr.next_roots = 1
        packed = pack_trees(trees)
        logits = favour_drafts(torch.randn(T, packed.max_nodes, vocab) * 2, trees, rng, 0.6)
        kinds = [rng.choice(["greedy", "keyed", "keyed", "random"]) for _ in range(T)]
        params = [SamplingParams(temperature=0.0) if k == "greedy" else SamplingParams(temperature=0.9, top_p=0.95)
                  for k in kinds]
        keys = [sample_key(1000 + t) if k != "random" else None for t, k in enumerate(kinds)]
        positions = [rng.randint(0, 50) for _ in range(T)]
        st = SamplingTensors.from_params(params, "cpu", keys)
        res = host_results(verify_batched(packed, logits, st, positions=positions))
        masked = host_results(verify_batched(packed, logits, st, positions=positions, compact=False))
        assert [r for r, k in zip(res, kinds) if k != "random"] == [r for r, k in zip(masked, kinds) if k != "random"]
        for t, (tr, r) in enumerate(zip(trees, res)):
            if kinds[t] != "keyed":
                continue
            one = SamplingTensors.from_params([params[t]], "cpu", [keys[t]])
            path = [r.root] + r.accepted_nodes
            plain = [int(sample(logits[t, node][None], one, [positions[t] + k]).token_ids[0])
                     for k, node in enumerate(path)]
            assert r.tokens == plain
            depths = tree_mod.tree_depths(tr.parents)
            node_samples = [int(sample(logits[t, i][None], one, [positions[t] + depths[i]]).token_ids[0])
                            for i in range(tr.num_nodes)]
            assert r == verify_greedy(tr.tokens, tr.parents, node_samples)
            accepted += len(r.accepted_nodes)
    assert accepted > 15   # the walks went deep enough to mean something


SYNC_METHODS = ["item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"]


@contextlib.contextmanager
def no_host_sync(device: str = "cpu"):
    """Every Tensor method that brings a device value to the host raises inside the block; on CUDA
    also any operation that waits for the device (`torch.cuda.set_sync_debug_mode("error")`: a
    `nonzero`, a data-dependent shape)."""
    def boom(*args, **kwargs):
        raise AssertionError("host sync inside batched verification")
    saved = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}
    cuda = torch.device(device).type == "cuda"
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        for name in SYNC_METHODS:
            setattr(torch.Tensor, name, boom)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        if cuda:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("device", DEVICES)
def test_batched_verification_does_no_host_sync(device):
    rng = random.Random(5)
    vocab = 11
    trees = mixed_batch(rng, 9, vocab)
    trees.append(TokenTree([1, 2, 3, 4], [NO_PARENT, NO_PARENT, 0, 1], next_roots=3))
    T = len(trees)
    packed = pack_trees(trees, device)
    logits = torch.randn(T, packed.max_nodes, vocab).to(device)
    gens = [torch.Generator(device).manual_seed(t) if t % 2 else None for t in range(T)]
    params = [SamplingParams(temperature=0.0) if t % 3 == 0 else SamplingParams(temperature=1.0, top_p=0.8)
              for t in range(T)]
    st = SamplingTensors.from_params(params, device)
    st_keyed = SamplingTensors.from_params(params, device, [sample_key(t) if t % 2 else None for t in range(T)])
    st_greedy = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * T, device)
    st_random = SamplingTensors.from_params([SamplingParams(temperature=1.0, top_k=4)] * T, device)
    probs = torch.softmax(logits, -1)
    argmax = logits.argmax(-1)
    positions = torch.arange(T, device=device)     # staged with the step's inputs, as the runner does
    with no_host_sync(device):
        # compact=False: the CUDA path (the compacting CPU path reads row counts, free on a CPU)
        out = [verify_batched(packed, logits, st, gens, compact=False),
               verify_batched(packed, logits, st_greedy, gens, compact=False),
               verify_batched(packed, logits, st_keyed, gens, compact=False, positions=positions),
               verify_batched(packed, logits, st_random, gens, any_greedy=False, compact=False),
               verify_greedy_batched(packed, argmax), verify_sampling_batched(packed, probs, gens, compact=False)]
        stacked = [r.stacked() for r in out]
    with pytest.raises(AssertionError, match="host sync"):
        with no_host_sync():
            argmax.tolist()
    for s in stacked:   # and the results are sane once on the host
        assert len(verify_results_from_stacked(s.tolist(), packed.max_depth)) == T


def test_compacting_and_masked_paths_give_the_same_results():
    """The CPU path (rows still walking selected with nonzero) and the CUDA path (every row, masks)
    draw the same random numbers and must decide the same, for every tree."""
    rng = random.Random(21)
    vocab = 9
    for trial in range(12):
        T = rng.randint(1, 10)
        trees = mixed_batch(rng, T, vocab, max_nodes=10)
        packed = pack_trees(trees)
        logits = favour_drafts(torch.randn(T, packed.max_nodes, vocab) * 2, trees, rng, 0.7)
        params = [SamplingParams(temperature=0.0) if t % 4 == 0 else SamplingParams(temperature=0.9, top_p=0.9)
                  for t in range(T)]
        st = SamplingTensors.from_params(params, "cpu")
        probs = torch.softmax(logits, -1)
        results = []
        for compact in (True, False):
            torch.manual_seed(trial)
            gens = [torch.Generator().manual_seed(trial * 100 + t) if t % 2 else None for t in range(T)]
            results.append([host_results(verify_batched(packed, logits, st, gens, compact=compact)),
                            host_results(verify_sampling_batched(packed, probs, gens, compact=compact))])
        assert results[0] == results[1]

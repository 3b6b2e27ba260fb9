"""The eagle drafter (one decoder layer over target features, own paged KV, dynamic trees):
greedy output equals plain decoding with drafts really accepted, sampled output follows the target's
law, its KV cache only ever keeps rows computed from the target's real features, trees respect the
budget, preemption and a missing checkpoint are handled."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (empirical_first_two_law, exact_first_two_law, feature_drafter_engine, run_requests,
                     teacher_batch, total_variation, varied_prompts_and_plain)

import specserve.drafters.eagle  # noqa: F401  (registers "eagle" until base._import_builtin lists it)
from specserve.drafters.base import DraftRequest, make_drafter
from specserve.drafters.eagle import EagleDrafter, _Node
from specserve.drafters.train.data import label_ranking
from specserve.drafters.train.eagle import EagleHead, fit_eagle
from specserve.drafters.train.loop import TrainConfig
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, tree_depths

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


# this file's engine: 6 sequences, 300 KV blocks, context 128, 60 draft tokens per step
make_engine = feature_drafter_engine


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    """Prompts of different lengths and their plain greedy continuations."""
    return varied_prompts_and_plain(tiny_llama_dir, GREEDY)


@pytest.fixture(scope="module")
def trained_head(tiny_llama_dir, prompts_and_plain) -> EagleHead:
    """A head distilled in about 2 s from the tiny target's own greedy continuations of the test
    prompts (a random tiny model continues every prompt differently: only these can be learnt)."""
    from specserve.engine.loader import load_model
    from specserve.engine.config import ModelConfig
    from specserve.engine.model import LlamaModel

    prompts, plain = prompts_and_plain
    loaded = load_model(str(tiny_llama_dir))
    cfg = ModelConfig.from_hf(loaded.hf_config)
    model = LlamaModel.from_state_dict(cfg, loaded.state_dict, max_positions=256, dtype=torch.float32,
                                       device=torch.device("cpu"))
    seqs = [p + plain[f"r{i}"] for i, p in enumerate(prompts)]
    batch = teacher_batch(model, seqs, [len(p) for p in prompts])
    config = TrainConfig(epochs=100, lr=1e-2, warmup_steps=5, patience=None, progress=False, device="cpu")
    head = fit_eagle(model, [batch], None, config=config, noise=0.05, negatives=None, max_len=128).head
    head.set_vocab_rank(label_ranking([batch], cfg.vocab_size)[0])
    return head


@pytest.mark.parametrize("shape", [{}, {"depth": 4, "top_k": 1, "width": 1}, {"depth": 3, "top_k": 6, "width": 2},
                                   {"draft_vocab": 100}], ids=["default", "chain", "wide", "draft_vocab"])
def test_greedy_is_lossless_and_drafts_are_accepted(tiny_llama_dir, prompts_and_plain, trained_head, shape):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"head": trained_head, **shape}})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["eagle"]
    assert stats.num_fallbacks == 0
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0.2 * sum(len(v) for v in plain.values())
    drafter = engine.drafters["eagle"]
    assert drafter.head is trained_head                     # an in-memory head is used by reference
    if "draft_vocab" in shape:                              # drafts come from the 100 most frequent labels
        assert drafter.vocab.weight.shape == (100, 64)
        assert set(drafter.vocab.ids.tolist()) == set(trained_head.vocab_rank[:100].tolist())
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter.state
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_untrained_head_is_lossless_too(tiny_llama_dir, prompts_and_plain):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"random_init": True}})
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["eagle"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
    # standardized walltime: one run per sequence per draft-distribution read (the root, then at
    # most depth - 1 levels); cost = the head plus the LM-head rows it multiplies, over the target
    drafter = engine.drafters["eagle"]
    runs, cost = drafter.model_runs()["eagle"]
    assert stats.num_steps <= runs <= stats.num_steps * drafter.depth
    target = sum(p.numel() for p in engine.model.parameters())
    head = sum(p.numel() for p in drafter.head.parameters())
    vocab = drafter.vocab.size or engine.model_config.vocab_size
    assert cost == pytest.approx((head + vocab * engine.model_config.hidden_size) / target)


def test_preemption_restarts_the_drafters_rows(tiny_llama_dir, prompts_and_plain, trained_head):
    """A KV pool too small for every sequence: preempted sequences are recomputed from position 0,
    and the drafter rebuilds its rows from the features delivered again."""
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"head": trained_head}}, num_kv_blocks=40)
    assert run_requests(engine, prompts, GREEDY, stagger=False) == plain
    assert engine.scheduler.num_preemptions > 0
    stats = engine.get_stats().drafters["eagle"]
    assert stats.num_fallbacks == 0 and stats.num_accepted_tokens > 0


def test_kv_holds_only_rows_of_real_features(tiny_llama_dir, prompts_and_plain, trained_head):
    """After many speculative steps the drafter's KV rows equal those of a fresh catch-up over the
    target's real features (computed by transformers), and differ from the rows the tree had
    computed from predicted features at the same positions: no stale predicted-feature KV is kept."""
    import transformers

    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"head": trained_head}})
    drafter: EagleDrafter = engine.drafters["eagle"]
    prompts = prompts_and_plain[0][:3]                      # continuations the head has learnt
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tree_rows: dict[tuple[int, int], torch.Tensor] = {}     # (seq id, position) -> KV of a predicted-feature row
    original = drafter.propose

    def spy(seqs, budgets):
        trees = original(seqs, budgets)
        for seq, tree in zip(seqs, trees):
            st = drafter.state.get(seq.seq_id)
            if tree is not None and st is not None and max(tree_depths(tree.parents)) >= 2:   # a row was fed
                slot = drafter.blocks.slot(seq.seq_id, st.kv_len)   # the first tree row (a depth-1 node)
                tree_rows[(seq.seq_id, st.kv_len)] = drafter.cache.kv[:, 0, slot].clone()
        return trees

    drafter.propose = spy
    for _ in range(30):
        engine.step()
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    assert len(seqs) == 3 and all(s.num_output_tokens > 20 for s in seqs)
    assert engine.get_stats().drafters["eagle"].num_accepted_tokens > 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    fresh = make_drafter("eagle", target=engine.model, model_config=engine.model_config, device=torch.device("cpu"),
                         dtype=torch.float32, max_model_len=128, head=trained_head, block_size=4)
    compared_tree_rows = 0
    for seq in seqs:
        n = drafter.state[seq.seq_id].kv_len
        assert n >= len(seq.token_ids) - 12 and n > 30
        with torch.no_grad():
            feats = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states[-1][0]
        fresh.start(seq)
        fresh.observe([seq], [(0, feats)])
        view = prefix_view(seq, n + 1)                       # catch up exactly rows 0 .. n-1
        assert fresh.catch_up([view]) == [True]
        ours = drafter.cache.kv[:, 0, drafter.blocks.slots(seq.seq_id, 0, n)]
        want = fresh.cache.kv[:, 0, fresh.blocks.slots(seq.seq_id, 0, n)]
        torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
        for (sid, pos), kv in tree_rows.items():
            if sid == seq.seq_id and pos < n:
                compared_tree_rows += 1
                real = fresh.cache.kv[:, 0, fresh.blocks.slot(seq.seq_id, pos)]
                assert not torch.allclose(kv, real, atol=1e-3)   # the predicted-feature row was not kept
    assert compared_tree_rows > 10


def prefix_view(seq, n) -> DraftRequest:
    """The view of a sequence through its first `n` tokens."""
    return DraftRequest(seq.seq_id, tuple(seq.token_ids[:n]), seq.num_prompt_tokens, seq.params)


def test_dynamic_trees_fit_the_budget_and_are_level_major(tiny_llama_dir, trained_head):
    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"head": trained_head, "depth": 5, "top_k": 3,
                                                               "width": 3}})
    drafter = engine.drafters["eagle"]
    seen = []
    original = drafter.propose

    def spy(seqs, budgets):
        trees = original(seqs, budgets)
        seen.extend(zip(budgets, trees))
        return trees

    drafter.propose = spy
    g = torch.Generator().manual_seed(3)
    run_requests(engine, [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 9, 14)], GREEDY)
    assert seen
    for budget, tree in seen:
        assert tree is not None and tree.draft_probs is None           # deterministic drafts
        assert 1 <= tree.num_draft_tokens <= budget
        depths = tree_depths(tree.parents)
        assert depths == sorted(depths) and max(depths) <= min(5, budget)   # level-major, depth-capped
        for node in range(1, tree.num_nodes):                          # distinct siblings
            sibs = [tree.tokens[i] for i in range(1, tree.num_nodes) if tree.parents[i] == tree.parents[node]]
            assert len(sibs) == len(set(sibs)) and len(sibs) <= 3
    assert any(t.num_draft_tokens == b >= 6 for b, t in seen)          # wide budgets are filled


def trees_drafted(engine, drafter_name: str, prompts) -> tuple[dict, list]:
    """(outputs, every propose call's (budgets, trees as token/parent lists)) of greedy `prompts`."""
    drafter, calls = engine.drafters[drafter_name], []
    original = drafter.propose

    def spy(seqs, budgets):
        trees = original(seqs, budgets)
        calls.append((list(budgets), [(t.tokens, t.parents) if t is not None else None for t in trees]))
        return trees

    drafter.propose = spy
    return run_requests(engine, prompts, GREEDY), calls


@pytest.mark.parametrize("name,shape", [("eagle", {}), ("eagle", {"depth": 4, "top_k": 1, "width": 1}),
                                        ("eagle", {"depth": 3, "top_k": 6, "width": 2}), ("eagle3", {})],
                         ids=["eagle", "chain", "wide", "eagle3"])
def test_the_device_tree_drafts_the_host_trees(tiny_llama_dir, prompts_and_plain, name, shape):
    """drafters/device_tree.py: the tree grown on the device in the fixed shape of the step's largest
    budget, eagerly and replayed through the graph stand-in, is the host tree at every step and
    every budget (the fixed policy's budgets shrink as requests near their end)."""
    from specserve.engine.cuda_graphs import EagerReplay

    prompts, plain = prompts_and_plain[0][:6], {f"r{i}": prompts_and_plain[1][f"r{i}"] for i in range(6)}
    runs = {}
    for mode in ("host", "device", "graphs"):
        options = {"random_init": True, "init": "last", "device_tree": mode != "host", **shape}
        engine = make_engine(tiny_llama_dir, [name], {name: options}, num_speculative_tokens=12)
        drafter = engine.drafters[name]
        assert (drafter.device_tree is None) == (mode == "host")
        if mode == "graphs":   # batch buckets 1, 2, 4, 6 x the shapes of budgets 1, 2, 4, 8, 12
            assert drafter.capture_graphs(EagerReplay(), [0, 1, 2, 4, 8, 12]) == 4 * len(
                {(min(d, b), min(w, b), min(k, b)) for d, w, k in [(shape.get("depth", 6), shape.get("width", 4),
                                                                    shape.get("top_k", 4))] for b in (1, 2, 4, 8, 12)})
        runs[mode] = trees_drafted(engine, name, prompts)
        assert runs[mode][0] == plain
        if mode == "graphs":
            assert drafter.device_tree.num_replays == len(runs[mode][1])
    host, device, graphs = (runs[m][1] for m in ("host", "device", "graphs"))
    assert len({b for budgets, _ in host for b in budgets}) >= 4 and any(len(b) > 1 for b, _ in host)
    assert device == host and graphs == host


def test_forced_tokens_grow_on_the_host_beside_device_trees(tiny_llama_dir, prompts_and_plain):
    """A sequence drafting after a grammar's forced tokens grows its tree on the host, in the same
    call as the others' device trees: the outputs of the host tree for every request."""
    from specserve.engine.cuda_graphs import EagerReplay

    schema = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                          "size": {"type": "integer"}}, "required": ["name", "size"]})
    prompts = prompts_and_plain[0][:4]
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=40, guided=("json", schema)), GREEDY, GREEDY]
    outs, trees, mixed = {}, {}, []
    for device_tree in (False, True):
        engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"random_init": True, "device_tree": device_tree}})
        drafter, calls = engine.drafters["eagle"], trees.setdefault(device_tree, [])
        if device_tree:
            drafter.capture_graphs(EagerReplay(), [1, 2, 4, 8, 16])
        propose = drafter.propose

        def spy(seqs, budgets, propose=propose, calls=calls):
            mixed.append(0 < sum(bool(s.hypothetical) for s in seqs) < len(seqs))
            out = propose(seqs, budgets)
            calls.append([(s.hypothetical, t.tokens, t.parents) if t else None for s, t in zip(seqs, out)])
            return out

        drafter.propose = spy
        outs[device_tree] = run_requests(engine, prompts, params)
    assert outs[True] == outs[False] and trees[True] == trees[False]   # forced tokens: the host's tree after them
    assert any(mixed) and drafter.device_tree.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draft_graphs_give_the_host_trees(tiny_llama_dir, prompts_and_plain):
    """On CUDA the engine captures the device tree's graphs at start-up (device_tree=auto); replayed,
    they draft the host's trees (fp32: up to the last bit of logits computed in other batch shapes)
    and the greedy output of the eager host tree."""
    prompts = prompts_and_plain[0][:6]
    runs = {}
    for mode in ("host", "auto"):
        options = {"random_init": True, "init": "last", "device_tree": "auto" if mode == "auto" else "false"}
        engine = make_engine(tiny_llama_dir, ["eagle3"], {"eagle3": options}, device="cuda", num_speculative_tokens=12)
        drafter = engine.drafters["eagle3"]
        assert (drafter.device_tree is not None and len(drafter.device_tree.replays) > 0) == (mode == "auto")
        runs[mode] = trees_drafted(engine, "eagle3", prompts)
        if mode == "auto":
            assert drafter.device_tree.num_replays == len(runs[mode][1])
    assert runs["auto"][0] == runs["host"][0]
    same = sum(a == b for a, b in zip(runs["host"][1], runs["auto"][1]))
    assert same >= 0.9 * len(runs["host"][1]), (same, len(runs["host"][1]))


def test_the_device_tree_option_is_checked(tiny_llama_dir):
    with pytest.raises(ValueError, match="device_tree must be auto, true or false"):
        make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"random_init": True, "device_tree": "maybe"}})
    engine = make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"random_init": True}})
    assert engine.drafters["eagle"].device_tree is None          # auto: on CUDA only


def test_select_keeps_the_best_scoring_ancestor_closed_set():
    #                 token parent depth score  rank
    nodes = [_Node(10, -1, 1, -0.1, 0), _Node(11, -1, 1, -2.0, 1),
             _Node(20, 0, 2, -0.3, 0), _Node(21, 0, 2, -3.0, 1), _Node(22, 1, 2, -2.1, 0),
             _Node(30, 2, 3, -0.3, 0)]                                 # ties with its parent
    tree = EagleDrafter._select(5, nodes, 4)
    assert tree.tokens == [5, 10, 11, 20, 30] and tree.parents == [NO_PARENT, 0, 0, 1, 3]
    assert EagleDrafter._select(5, nodes, 2).tokens == [5, 10, 20]


def test_no_checkpoint_says_how_to_train_one(tiny_llama_dir):
    with pytest.raises(ValueError, match="specserve train eagle"):
        make_engine(tiny_llama_dir, ["eagle"])
    with pytest.raises(ValueError, match="vocab_rank"):                 # draft_vocab needs a trained ranking
        make_engine(tiny_llama_dir, ["eagle"], {"eagle": {"random_init": True, "draft_vocab": 100}})


# ---- sampling ---------------------------------------------------------------------------------

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
SAMPLING = SamplingParams(temperature=1.0, top_k=3, max_tokens=4, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06    # E[TV] of 1500 draws over 9 outcomes is about 0.03; a forgotten residual gives about 0.12


# an untrained head whose layer is the target's last one drafts tokens inside the target's top-3
# often enough for a wrong residual to show (a fresh random layer rarely does)
SAMPLING_OPTIONS = {"random_init": True, "init": "last", "top_k": 2, "width": 2, "depth": 3}


def test_sampled_tokens_follow_the_target_law(peaky_target):
    """Deterministic top-k trees (one-hot q) under sampling: the joint law of the first two tokens
    equals the target's, and drafts are both accepted and rejected along the way."""
    emp, engine = empirical_first_two_law(peaky_target, "eagle", SAMPLING_OPTIONS, PROMPT, SAMPLING, TRIALS)
    stats = engine.get_stats().drafters["eagle"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) < TV_BOUND


def test_the_law_test_sees_a_wrong_residual(peaky_target, monkeypatch):
    """Control: with the rejected draft's mass left in p the same bound fails."""
    from specserve.engine import verify

    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)
    emp, _ = empirical_first_two_law(peaky_target, "eagle", SAMPLING_OPTIONS, PROMPT, SAMPLING, TRIALS)
    assert total_variation(emp, exact_first_two_law(peaky_target, PROMPT, SAMPLING)) > TV_BOUND

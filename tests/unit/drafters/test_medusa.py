"""The Medusa drafter: trees built from the heads' top-k per depth, greedy losslessness through the
engine (untrained and briefly trained heads, staggered arrivals), agreement of the engine's τ with
the trainer's offline decoding walk (the offsets of heads and features line up), and sampling
losslessness (joint law of the first two tokens against the exact target law)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from helpers import (draft_view, empirical_first_two_law, exact_first_two_law, make_llm_engine, run_requests,
                     total_variation)

from specserve.drafters import medusa as medusa_module
from specserve.drafters.base import make_drafter
from specserve.drafters.medusa import MedusaDrafter, parse_tree_option
from specserve.drafters.train.medusa import (MedusaExamples, MedusaHeads, chain_tau, fit_medusa, head_ranks,
                                             sequence_examples)
from specserve.engine import verify
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import TreeTemplate, build_tree_buffers

assert medusa_module  # registered


def make_engine(model_dir, drafters=("medusa",), options=None, **kw):
    """An engine speculating with medusa (its `options`) unless `drafters` says otherwise."""
    return make_llm_engine(model_dir, drafters, {"medusa": options} if options is not None else {}, **kw)


GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts_and_plain(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, drafters=())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()
               for n in (6, 19, 11, 33, 4, 25)]
    return prompts, run_requests(engine, prompts, GREEDY)


# ---------------------------------------------------------------------------------------------- trees

def _drafter(engine_or_model, model_config, **options) -> MedusaDrafter:
    return make_drafter("medusa", target=engine_or_model, model_config=model_config, device=torch.device("cpu"),
                        dtype=torch.float32, max_model_len=160, max_num_seqs=4, **options)


def test_tree_tokens_are_the_heads_top_k_by_depth_and_rank(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, drafters=())
    order = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0]]
    d = _drafter(engine.model, engine.model_config, random_init=True, init_std=0.1, tree=str(order))
    seq = draft_view(7, [5, 6, 7, 8, 9])
    h = torch.randn(4, 64)
    d.observe([seq], [(0, h)])                                   # features of positions 0..3: the root is 4
    tree, none = d.propose([seq, draft_view(8, [1, 2])], [5, 5])
    assert none is None                                          # no features for that sequence
    assert d.model_runs()["medusa"][0] == 2                      # 2 heads read for the one live sequence
    # budget 5: the first five paths of the order, laid out level-major
    tpl = TreeTemplate.from_choices(order[:5])
    assert tree.parents == list(tpl.parents) and tree.tokens[0] == 9 and tree.draft_probs is None
    with torch.no_grad():
        logits = engine.model.compute_logits(d.heads(h[-1:])[0])        # [K, vocab]
    top = logits.topk(3, dim=-1).indices
    depths = build_tree_buffers(tree.parents).depths.tolist()
    for node in range(1, tree.num_nodes):
        assert tree.tokens[node] == int(top[depths[node] - 1, tpl.ranks[node]])
    # a budget beyond the order is the whole order; a stale feature (not right before the root) gives no tree
    assert d.propose([seq], [50])[0].num_draft_tokens == len(order)
    assert d.propose([draft_view(7, [5, 6, 7, 8, 9, 11])], [5]) == [None]
    # after k hypothetical tokens (a grammar's forced ones) depth d is head k + d's, cut where the heads run out
    after = d.propose([draft_view(7, [5, 6, 7, 8, 9, 40], num_committed=5)], [5])[0]
    after_depths = build_tree_buffers(after.parents).depths.tolist()
    assert after.tokens[0] == 40 and after.parents == list(tpl.parents)[:after.num_nodes] and d.num_heads >= 3
    assert all(after.tokens[n] == int(top[after_depths[n], tpl.ranks[n]]) for n in range(1, after.num_nodes))
    # standardized walltime: the depth-3 tree read 3 more heads; each read costs one head plus the LM head
    runs, cost = d.model_runs()["medusa"]
    hidden, vocab = engine.model_config.hidden_size, engine.model_config.vocab_size
    assert runs == 2 + 3 + 3   # and the tree after one hypothetical token: heads 1..2 for its depth 2, read from 0
    assert cost == pytest.approx((hidden * hidden + hidden + vocab * hidden)
                                 / sum(p.numel() for p in engine.model.parameters()))


def test_draft_vocab_restricts_tree_tokens_to_the_ranked_ones(tiny_llama_dir, tmp_path):
    """With a ranking and draft_vocab=N, each depth's candidates are the heads' top tokens among
    the first N ranked ones; the ranking travels with a checkpoint's tensors."""
    engine = make_engine(tiny_llama_dir, drafters=())
    vocab_size = engine.model_config.vocab_size
    heads = MedusaHeads(4, 64).randomize_(0.1, seed=3)
    heads.vocab_rank = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(2))
    loaded = MedusaHeads.from_tensors(heads.state_tensors(), dtype=torch.float32, device="cpu")
    assert torch.equal(loaded.vocab_rank, heads.vocab_rank)
    order = [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]
    d = _drafter(engine.model, engine.model_config, heads=loaded, draft_vocab=20, tree=str(order))
    allowed = heads.vocab_rank[:20]
    seq = draft_view(1, [5, 6, 7, 8, 9])
    h = torch.randn(4, 64)
    d.observe([seq], [(0, h)])
    tree = d.propose([seq], [6])[0]
    with torch.no_grad():
        logits = engine.model.compute_logits(loaded(h[-1:])[0])[:, allowed]     # [K, 20]
    top = allowed[logits.topk(3, dim=-1).indices]
    depths = build_tree_buffers(tree.parents).depths.tolist()
    tpl = TreeTemplate.from_choices(order)
    for node in range(1, tree.num_nodes):
        assert tree.tokens[node] == int(top[depths[node] - 1, tpl.ranks[node]])
    with pytest.raises(ValueError, match="vocab_rank"):          # no ranking: an explicit size is refused
        _drafter(engine.model, engine.model_config, random_init=True, draft_vocab=20)


def test_tree_options(tiny_llama_dir):
    assert parse_tree_option("chain", 3) == [[0], [0, 0], [0, 0, 0]]
    assert parse_tree_option("[[0], [1]]", 3) == [[0], [1]]
    assert parse_tree_option("auto", 3) is None
    engine = make_engine(tiny_llama_dir, drafters=())
    d = _drafter(engine.model, engine.model_config, random_init=True, num_heads=2)
    assert d.order and all(len(p) <= 2 for p in d.order)        # deeper template paths are dropped
    tpl = d.template(8)[0]
    assert tpl.num_nodes == 9
    with pytest.raises(ValueError):
        parse_tree_option("no_such_tree_anywhere", 3)


# ---------------------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("options", [{"random_init": True}, {"random_init": True, "init_std": 0.05, "seed": 1}],
                         ids=["zero-heads", "random-heads"])
def test_greedy_is_lossless_with_untrained_heads(tiny_llama_dir, prompts_and_plain, options):
    prompts, plain = prompts_and_plain
    engine = make_engine(tiny_llama_dir, options=options)
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["medusa"]
    assert stats.num_steps > 0 and stats.num_draft_tokens > 0 and stats.num_fallbacks == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert len(engine.features) == 0                             # finished sequences' features dropped


def _chat_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    from specserve.drafters.train.data import render_prompt

    rng = random.Random(seed)
    words = "the quick brown fox jumps over lazy dog hello world capital of France Paris is what".split()
    return [render_prompt(tokenizer, [" ".join(rng.choice(words) for _ in range(rng.randint(3, 10)))])
            for _ in range(n)]


def _examples(model, prompts, outputs) -> MedusaExamples:
    """Rows of the target's own greedy answers (features recomputed by teacher forcing)."""
    from specserve.drafters.train.target import target_features

    seqs = [p + o for p, o in zip(prompts, outputs)]
    parts = []
    for p, s, h in zip(prompts, seqs, target_features(model, seqs)):
        with torch.no_grad():
            labels = model.compute_logits(h).argmax(-1)
        assert labels[len(p) - 1:-1].tolist() == s[len(p):]      # greedy answers
        mask = torch.zeros(len(s), dtype=torch.bool)
        mask[len(p) - 1:-1] = True
        parts.append(sequence_examples(h, labels, 4, mask))
    return MedusaExamples.cat(parts, 4, model.cfg.hidden_size)


def train_heads(model_dir, prompts: list[list[int]] | None = None, epochs: int = 4) -> MedusaHeads:
    """Heads trained for a few seconds on the target's own greedy answers (to chat prompts by default)."""
    from specserve.drafters.train.loop import TrainConfig

    engine = make_engine(model_dir, drafters=(), max_num_seqs=16, max_num_batched_tokens=512,
                         num_kv_blocks=1200, max_model_len=256)
    prompts = prompts or _chat_prompts(engine.tokenizer, 48, seed=0)
    answers = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
                           stagger=False)
    ex = _examples(engine.model, prompts, [answers[f"r{i}"] for i in range(len(prompts))])
    heads, _ = fit_medusa(engine.model, ex, ex.head(0), batch_size=64, num_negatives=None,
                          config=TrainConfig(epochs=epochs, lr=3e-3, progress=False, patience=None))
    return heads


@pytest.fixture(scope="module")
def trained_heads(tiny_llama_dir):
    return train_heads(tiny_llama_dir)


def test_greedy_is_lossless_with_trained_heads_and_drafts_get_accepted(tiny_llama_dir, trained_heads):
    engine = make_engine(tiny_llama_dir, drafters=(), max_model_len=256)
    prompts = _chat_prompts(engine.tokenizer, 6, seed=1)
    plain = run_requests(engine, prompts, GREEDY)
    engine = make_engine(tiny_llama_dir, options={"heads": trained_heads}, max_model_len=256)
    assert run_requests(engine, prompts, GREEDY) == plain
    stats = engine.get_stats().drafters["medusa"]
    assert stats.num_accepted_tokens > 0.1 * sum(len(v) for v in plain.values())
    assert len(stats.accepted_by_depth) >= 3                     # deeper heads got accepted too


def test_greedy_is_lossless_with_a_draft_vocabulary(tiny_llama_dir, trained_heads):
    heads = copy.deepcopy(trained_heads)
    engine = make_engine(tiny_llama_dir, drafters=(), max_model_len=256)
    prompts = _chat_prompts(engine.tokenizer, 4, seed=2)
    plain = run_requests(engine, prompts, GREEDY)
    counts = torch.bincount(torch.tensor([t for v in plain.values() for t in v]),
                            minlength=engine.model_config.vocab_size)
    heads.vocab_rank = torch.argsort(-counts, stable=True)      # the target's own output tokens first
    engine = make_engine(tiny_llama_dir, options={"heads": heads, "draft_vocab": 32}, max_model_len=256)
    assert run_requests(engine, prompts, GREEDY) == plain
    assert engine.drafters["medusa"].vocab.size == 32
    assert engine.get_stats().drafters["medusa"].num_accepted_tokens > 0


def test_engine_tau_matches_the_offline_walk(tiny_llama_dir, trained_heads):
    """With a fixed chain of the 4 heads' top-1, the engine's τ is what the trainer's decoding walk
    over the same greedy answers predicts: the heads read the right features at the right offsets."""
    engine = make_engine(tiny_llama_dir, drafters=(), max_num_seqs=8, max_num_batched_tokens=512,
                         num_kv_blocks=800, max_model_len=256)
    prompts = _chat_prompts(engine.tokenizer, 8, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = run_requests(engine, prompts, params, stagger=False)
    spec = make_engine(tiny_llama_dir, options={"heads": trained_heads, "tree": "chain"}, max_num_seqs=8,
                       max_num_batched_tokens=512, num_kv_blocks=800, max_model_len=256,
                       draft_budget="fixed", num_speculative_tokens=4, max_draft_tokens_per_step=64)
    assert run_requests(spec, prompts, params, stagger=False) == plain
    stats = spec.get_stats().drafters["medusa"]
    engine_tau = (stats.num_accepted_tokens + stats.num_steps) / stats.num_steps
    ex = _examples(engine.model, prompts, [plain[f"r{i}"] for i in range(len(prompts))])
    offline = chain_tau(head_ranks(trained_heads, engine.model.lm_head_weight, ex), ex.seq)
    assert engine_tau > 1.2
    assert engine_tau == pytest.approx(offline, abs=0.03)


# ---------------------------------------------------------------------------------------------- sampling

PROMPT = [7, 100, 42, 9, 250, 31, 7, 100, 42, 9, 250, 31, 7, 100]
PARAMS = SamplingParams(temperature=1.0, top_k=3, max_tokens=5, ignore_eos=True)
TRIALS = 1500
TV_BOUND = 0.06    # E[TV] of 1500 draws over 9 outcomes is about 0.03 (a wrong residual rule gives about 0.15)


@pytest.fixture(scope="module")
def exact_law(peaky_target) -> dict[tuple[int, int], float]:
    return exact_first_two_law(peaky_target, PROMPT, PARAMS)


@pytest.fixture(scope="module")
def peaky_heads(peaky_target, exact_law):
    """Heads whose first one learned, at the prompt's last position, the law of the 2nd token (which
    it drafts without knowing the sampled 1st one): its top candidates cover that token's support,
    so drafts at the first verification are accepted and rejected often and the residual rule
    decides the joint law (a draft that never matches could not show a wrong rule)."""
    from specserve.drafters.train.loop import TrainConfig
    from specserve.drafters.train.target import target_features

    model = make_engine(peaky_target, drafters=()).model
    h = target_features(model, [PROMPT])[0][-1]
    second: dict[int, float] = {}
    for (_, u), pr in exact_law.items():
        second[u] = second.get(u, 0.0) + pr
    g = torch.Generator().manual_seed(0)
    tokens = list(second)
    draws = torch.multinomial(torch.tensor([second[u] for u in tokens]), 512, replacement=True, generator=g)
    targets = torch.full((512, 4), -1, dtype=torch.long)
    targets[:, 0] = torch.tensor(tokens)[draws]
    ex = MedusaExamples(h.expand(512, -1).clone(), targets, torch.zeros(512, 0, dtype=torch.long),
                        torch.arange(512))
    heads, _ = fit_medusa(model, ex, ex.head(0), batch_size=64, num_negatives=None,
                          config=TrainConfig(epochs=10, lr=1e-2, progress=False, patience=None))
    return heads


def empirical_law(target_dir, heads):
    return empirical_first_two_law(target_dir, "medusa", {"heads": heads}, PROMPT, PARAMS, TRIALS)


def test_sampling_follows_the_target_law(peaky_target, peaky_heads, exact_law):
    emp, engine = empirical_law(peaky_target, peaky_heads)
    stats = engine.get_stats().drafters["medusa"]
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert total_variation(emp, exact_law) < TV_BOUND


def test_a_wrong_residual_update_is_caught(peaky_target, peaky_heads, exact_law, monkeypatch):
    monkeypatch.setattr(verify, "residual_rows", lambda p, q: p)   # forget the rejected draft's mass
    emp, _ = empirical_law(peaky_target, peaky_heads)
    assert total_variation(emp, exact_law) > TV_BOUND

"""The draft-model drafter (SpS chains and MCSD trees, own pruned KV cache): greedy output equals
plain decoding. Its sampled output's law is tested in tests/unit/engine/test_sampling_lossless.py."""

from __future__ import annotations

import pytest
import torch

from specserve.drafters.draft_model import parse_k_config
from specserve.engine.config import EngineConfig
from specserve.engine.core import LLMEngine
from specserve.engine.sampling_params import SamplingParams


def engine_with(tiny_llama_dir, drafters=(), options=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny_llama_dir), dtype="float32", device="cpu", max_num_seqs=8, block_size=4,
               max_num_batched_tokens=128, num_kv_blocks=400, max_model_len=128, drafters=tuple(drafters),
               drafter_options=options or {}, num_speculative_tokens=12, max_draft_tokens_per_step=64,
               draft_budget="fixed")   # every draft verified: these tests are about the drafter
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for d in out.outputs:
                got.setdefault(f"{out.request_id}/{d.index}", []).extend(d.token_ids)
    return got


def test_parse_k_config():
    assert parse_k_config("4,2,2,1") == (4, 2, 2, 1)
    assert parse_k_config("chain:3") == (1, 1, 1)
    with pytest.raises(ValueError):
        parse_k_config("2,0")


@pytest.mark.parametrize("k_config", ["chain:4", "3,2,2,1", "2,2,1,1,1,1", "draft_vocab 3,2,2,1"])
def test_greedy_is_lossless(tiny_llama_dir, k_config):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = run(engine_with(tiny_llama_dir), prompts, params)
    options = {"k_config": k_config.split()[-1], "draft_layers": 1}
    if k_config.startswith("draft_vocab"):       # drafts only from the 64 tokens plain decoding uses most
        counts = torch.bincount(torch.tensor([t for v in plain.values() for t in v]), minlength=320)
        options.update(vocab_rank=torch.argsort(-counts, stable=True), draft_vocab=64)
    spec_engine = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": options})
    got = run(spec_engine, prompts, params)
    assert got == plain
    if "vocab_rank" in options:
        assert spec_engine.drafters["draft_model"].vocab.size == 64
    stats = spec_engine.get_stats().drafters["draft_model"]
    assert stats.num_steps > 0 and stats.num_fallbacks == 0
    assert spec_engine.blocks.num_free_blocks == spec_engine.blocks.num_blocks
    drafter = spec_engine.drafters["draft_model"]
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks   # the draft cache is freed too


def test_full_depth_draft_model_is_accepted_everywhere(tiny_llama_dir):
    """A 'draft model' that is the whole target must have every greedy draft accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"k_config": "chain:4", "draft_layers": 2}})
    run(eng, [[5, 9, 13, 200, 7]], params)
    st = eng.get_stats().drafters["draft_model"]
    assert st.num_accepted_tokens == st.num_draft_tokens > 0


# ---- MCSD target-initialised roots (lossy opt-in) -------------------------------------------------

from specserve.drafters.base import register                          # noqa: E402
from specserve.drafters.draft_model import DraftModelDrafter          # noqa: E402
from specserve.engine.attention import build_attn_metadata            # noqa: E402


@register("test_ti_recorder")
class RootRecorder(DraftModelDrafter):
    """draft_model, recording which root every verification kept."""

    def __init__(self, ctx, **kw):
        super().__init__(ctx, **kw)
        self.roots: list[int] = []
        self.num_forests = 0

    def propose(self, seqs, budgets):
        trees = super().propose(seqs, budgets)
        self.num_forests += sum(1 for t in trees if t is not None and t.num_roots > 1)
        return trees

    def accept(self, seqs, results):
        self.roots.extend(r.root for r in results)
        super().accept(seqs, results)


def _kv_of_fresh_prefill(model, cache_like, tokens: list[int]) -> torch.Tensor:
    from specserve.engine.kv_cache import BlockManager, KVCache

    n = len(tokens)
    blocks = BlockManager(-(-n // 4), 4)
    blocks.grow(0, n)
    cache = KVCache(model.num_layers, blocks.num_blocks, 4, cache_like.kv.shape[3], cache_like.kv.shape[4],
                    torch.float32, torch.device("cpu"))
    positions, meta = build_attn_metadata([blocks.block_tables[0]], 4, [0], [n], None, torch.device("cpu"))
    with torch.inference_mode():
        model(torch.tensor(tokens), positions, cache, meta)
    return cache.kv[:, :, blocks.slots(0, 0, n)]


def test_target_initialised_roots(tiny_llama_dir):
    """W = 2 target-initialised roots: sampled requests get forests whose kept root often is not the
    first-drawn one, nothing held back ever reaches the client before it is decided, both KV caches
    stay exactly what a fresh prefill of the committed tokens gives, and greedy requests in the
    same batch stay lossless."""
    options = {"test_ti_recorder": {"k_config": "2,1", "draft_layers": 1, "target_init_width": 2}}
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (7, 15, 10, 22)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = run(engine_with(tiny_llama_dir), prompts[:2], greedy)

    eng = engine_with(tiny_llama_dir, ["test_ti_recorder"], options)
    for i, p in enumerate(prompts):
        # unseeded: a seeded request reproduces plain decoding with its seed, so it never gets a forest
        params = greedy if i < 2 else SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
        eng.add_request(f"r{i}", p, params)
    drafter = eng.drafters["test_ti_recorder"]
    streamed: dict[str, list[int]] = {}
    seqs = {r: req.seqs[0] for r, req in eng.requests.items()}
    checked = False
    while eng.has_unfinished_requests():
        for out in eng.step():
            for d in out.outputs:
                streamed.setdefault(out.request_id, []).extend(d.token_ids)
        for rid, seq in seqs.items():
            # the client has seen every output token except a held-back one
            assert streamed.get(rid, []) == seq.output_token_ids[:seq.num_output_tokens - seq.held_back]
        sampled = [seqs["r2"], seqs["r3"]]
        if not checked and all(s.held_back and s.num_output_tokens > 20 for s in sampled) \
                and not any(s.is_finished for s in sampled):
            for seq in sampled:
                n = seq.num_computed_tokens
                assert n == len(seq.token_ids) - 1
                ref = _kv_of_fresh_prefill(eng.model, eng.cache, seq.token_ids[:n])
                torch.testing.assert_close(eng.cache.kv[:, :, eng.blocks.slots(seq.seq_id, 0, n)], ref,
                                           atol=1e-5, rtol=1e-5)
                m = drafter.state[seq.seq_id].draft_len
                assert m >= n - 3
                ref = _kv_of_fresh_prefill(drafter.model, drafter.cache, seq.token_ids[:m])
                torch.testing.assert_close(drafter.cache.kv[:, :, drafter.blocks.slots(seq.seq_id, 0, m)], ref,
                                           atol=1e-5, rtol=1e-5)
            checked = True
    assert checked
    assert {f"{k}/0": streamed[k] for k in ("r0", "r1")} == plain
    assert all(len(streamed[r]) == 40 for r in ("r2", "r3"))
    assert drafter.num_forests > 5
    # which root is kept is verification's business (tests/unit/engine/test_verify*.py cover forests
    # whose second root wins); here this draft model is good enough that the first root's walk is
    # usually accepted whole, so only legal roots are asserted
    assert drafter.roots and all(0 <= r < 2 for r in drafter.roots)
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks


def test_target_initialised_roots_respect_stops_and_abort(tiny_llama_dir):
    """A held-back token never outlives its request: max_tokens is exact, the last token is never
    held, and an aborted request reports no held-back token in its usage."""
    options = {"test_ti_recorder": {"k_config": "2", "draft_layers": 2, "target_init_width": 3}}
    eng = engine_with(tiny_llama_dir, ["test_ti_recorder"], options)
    for i, n in enumerate((3, 7, 12)):
        eng.add_request(f"r{i}", [5, 9, 13, 200, 7, 31][: 2 + i],
                        SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True))
    got = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            got.setdefault(out.request_id, []).extend(t for d in out.outputs for t in d.token_ids)
            if out.finished:
                assert out.num_generated_tokens == len(got[out.request_id])
    assert [len(got[f"r{i}"]) for i in range(3)] == [3, 7, 12]
    assert eng.drafters["test_ti_recorder"].num_forests > 0

    eng.add_request("a", [5, 9, 13], SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True))
    seq = eng.requests["a"].seqs[0]
    while not seq.held_back:
        eng.step()
    eng.abort_request("a")
    out = eng.step()
    assert out[0].finished and out[0].num_generated_tokens == seq.num_output_tokens
    assert not seq.held_back


def test_target_init_width_must_be_positive(tiny_llama_dir):
    with pytest.raises(ValueError, match="target_init_width"):
        engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"target_init_width": 0}})


# ---- review (the vertical cascade's inner verification) --------------------------------------------

def _draft_logits(model, tokens: list[int]) -> torch.Tensor:
    """The draft model's logits after every token of `tokens`, from a fresh cache: [len, vocab]."""
    from specserve.engine.kv_cache import BlockManager, KVCache

    n = len(tokens)
    blocks = BlockManager(-(-n // 4), 4)
    blocks.grow(0, n)
    cache = KVCache(model.num_layers, blocks.num_blocks, 4, model.cfg.num_kv_heads, model.cfg.head_dim,
                    torch.float32, torch.device("cpu"))
    positions, meta = build_attn_metadata([blocks.block_tables[0]], 4, [0], [n], None, torch.device("cpu"))
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), positions, cache, meta))


def test_review_accepts_the_models_own_chain_and_corrects_the_first_miss(tiny_llama_dir):
    """review(): the draft model's own greedy chain is accepted whole with its next greedy token as
    the bonus; a chain wrong at position 2 keeps 2 tokens and gets the greedy token there; a
    proposal from an extended prefix is reviewed as if those tokens were committed; afterwards the
    cache holds exactly the committed prefix's KV (what a fresh prefill gives)."""
    from specserve.engine.sequence import DraftRequest

    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1}})
    drafter = eng.drafters["draft_model"]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 9, 13, 200, 7, 31, 44]
    chain = list(prompt)
    for _ in range(6):
        chain.append(int(_draft_logits(drafter.model, chain)[-1].argmax()))
    own = chain[len(prompt):]
    seq = DraftRequest(1000, tuple(prompt), len(prompt), params)
    drafter.start(seq)
    assert drafter.review([seq], [own[:5]]) == [(5, own[5])]
    wrong = own[:2] + [(own[2] + 1) % 320] + own[3:5]
    assert drafter.review([seq], [wrong]) == [(2, own[2])]
    assert drafter.review([seq], [[]]) == [(0, own[0])]                  # no proposal: one greedy token
    ext = DraftRequest(1000, tuple(chain[:len(prompt) + 3]), len(prompt), params, num_committed=len(prompt))
    assert drafter.review([ext], [own[3:5]]) == [(2, own[5])]
    # batched: both in one forward, same answers
    assert drafter.review([seq, ext], [wrong, own[3:5]]) == [(2, own[2]), (2, own[5])]
    n = drafter.state[1000].draft_len
    assert n == len(prompt)
    ref = _kv_of_fresh_prefill(drafter.model, drafter.cache, prompt)
    torch.testing.assert_close(drafter.cache.kv[:, :, drafter.blocks.slots(1000, 0, n)], ref, atol=1e-5, rtol=1e-5)
    assert len(drafter.blocks.block_tables[1000]) == -(-n // drafter.kv.block_size)   # proposal rows freed


def test_review_leniency_accepts_tokens_within_its_factor_of_the_argmax(tiny_llama_dir):
    from specserve.engine.sequence import DraftRequest

    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1}})
    drafter = eng.drafters["draft_model"]
    prompt = [5, 9, 13, 200, 7, 31, 44]
    q = torch.softmax(_draft_logits(drafter.model, prompt)[-1], -1)
    top2 = q.topk(2)
    ratio = float(top2.values[0] / top2.values[1])                       # > 1: the runner-up's factor
    second = int(top2.indices[1])
    seq = DraftRequest(1001, tuple(prompt), len(prompt), SamplingParams(temperature=0.0))
    assert drafter.review([seq], [[second]], leniency=ratio * 0.999)[0][0] == 0
    assert drafter.review([seq], [[second]], leniency=ratio * 1.001)[0][0] == 1


def test_review_over_a_draft_vocabulary_rejects_tokens_outside_it(tiny_llama_dir):
    """With a draft vocabulary (even token ids) the review's argmax is the best even token, and an
    odd token is rejected whatever the leniency."""
    from specserve.engine.sequence import DraftRequest

    evens_first = torch.cat([torch.arange(0, 320, 2), torch.arange(1, 320, 2)])
    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1, "vocab_rank": evens_first,
                                                                        "draft_vocab": 160}})
    drafter = eng.drafters["draft_model"]
    prompt = [5, 9, 13, 200, 7, 31, 44]
    logits = _draft_logits(drafter.model, prompt)[-1]
    best_even = int(evens_first[:160][logits[evens_first[:160]].argmax()])
    best_odd = int(evens_first[160:][logits[evens_first[160:]].argmax()])
    seq = DraftRequest(1002, tuple(prompt), len(prompt), SamplingParams(temperature=0.0))
    assert drafter.review([seq], [[best_even]]) == [(1, drafter.review([seq.extend([best_even])], [[]])[0][1])]
    assert drafter.review([seq], [[best_odd]], leniency=1e30) == [(0, best_even)]


# ---- standardized walltime: model runs ------------------------------------------------------------

def test_model_runs_count_each_draft_forward_once_per_sequence_served(tiny_llama_dir):
    """A chain of 3 for two sequences: the catch-up forward and two level forwards (the last level
    is never fed), each serving both sequences = 6 runs; a review of both = 2 more; a budget of 1
    for one sequence = the catch-up alone. The cost ratio is a truncated target's share of the
    target's parameters (embedding and LM head counted as in the target)."""
    from specserve.engine.sequence import DraftRequest

    eng = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1, "k_config": "chain:3"}})
    drafter = eng.drafters["draft_model"]
    target = eng.model
    whole = sum(p.numel() for p in target.parameters())
    one_layer = whole - sum(p.numel() for layer in target.layers[1:] for p in layer.parameters())
    assert drafter.model_runs() == {"draft_model": (0, pytest.approx(one_layer / whole))}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    seqs = [DraftRequest(900 + i, tuple(p), len(p), params) for i, p in enumerate([[5, 9, 13, 200], [7, 31, 44]])]
    for s in seqs:
        drafter.start(s)
    trees = drafter.propose(seqs, [3, 3])
    assert all(len(t.tokens) == 4 for t in trees)
    assert drafter.model_runs()["draft_model"][0] == 3 * 2
    drafter.review(seqs, [[1, 2], [3]])
    assert drafter.model_runs()["draft_model"][0] == 3 * 2 + 2
    drafter.propose(seqs, [1, 0])
    assert drafter.model_runs()["draft_model"][0] == 3 * 2 + 2 + 1


def _recording(engine, strip_law: bool = False) -> list:
    """Record every (view, tree) the draft model proposes; with `strip_law`, propose as a drafter
    that ignores the request's processing would (the control)."""
    import dataclasses

    drafter, seen = engine.drafters["draft_model"], []
    propose = drafter.propose

    def recorded(views, budgets):
        views = [dataclasses.replace(v, law=None) for v in views] if strip_law else views
        trees = propose(views, budgets)
        seen.extend(zip(views, trees))
        return trees

    drafter.propose = recorded
    return seen


@pytest.mark.parametrize("strip_law", [False, True])
def test_sampled_drafts_come_from_the_requests_processed_law(tiny_llama_dir, strip_law):
    """A sampled request's logit_bias bans half the vocabulary: drafts drawn from the processed law
    never hold a banned token and are accepted more often; the control (drafts from the raw law)
    draws banned ones, which verification then rejects."""
    banned = set(range(3, 160))
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, logit_bias={t: -100 for t in banned})
    engine = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1, "k_config": "2,2,1"}})
    seen = _recording(engine, strip_law)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    out = run(engine, [torch.randint(3, 320, (n,), generator=g).tolist() for n in (6, 11)], params)
    assert not banned & {t for toks in out.values() for t in toks}          # the target's law bans them
    drafted = [t for _, tree in seen if tree is not None for t in tree.tokens[1:]]
    stats = engine.get_stats().drafters["draft_model"]
    assert len(drafted) > 50 and stats.num_draft_tokens > 0
    hits = sum(t in banned for t in drafted)
    if strip_law:
        assert hits > len(drafted) // 5
    else:
        assert hits == 0 and all(v.law is not None for v, _ in seen)


@pytest.mark.parametrize("strip_law", [False, True])
def test_sampled_drafts_under_a_grammar_stay_inside_it(tiny_llama_dir, strip_law):
    """Drafts drawn from the masked law are all allowed after their paths; the control (the raw
    law) drafts tokens the grammar forbids."""
    pytest.importorskip("llguidance")
    engine = engine_with(tiny_llama_dir, ["draft_model"], {"draft_model": {"draft_layers": 1, "k_config": "2,2,1"}})
    seen = _recording(engine, strip_law)
    guided = ("regex", r"[a-z ]{4,30}")
    torch.manual_seed(1)
    run(engine, [[7, 100, 42, 9, 250, 31], [5, 6, 7, 8, 9]],
        SamplingParams(temperature=1.0, max_tokens=24, guided=guided))
    trees = [(v, t) for v, t in seen if t is not None]
    assert len(trees) > 5
    inside = []
    for view, tree in trees:
        state = engine.grammars.state(guided)
        state.advance(list(view.output_token_ids))
        _, allowed = state.tree_masks(list(tree.tokens), list(tree.parents))
        ended: set[int] = set()          # EOS nodes and what follows them: the walk (`tree_masks`) stops there
        for i in range(1, tree.num_nodes):
            if tree.tokens[i] in engine.eos_token_ids or tree.parents[i] in ended:
                ended.add(i)
        inside.append(set(range(tree.num_nodes)) - ended <= set(allowed))   # every other node allowed after its path
    assert all(inside) != strip_law

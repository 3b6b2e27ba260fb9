"""The engine-owned feature store: per sequence, the target's post-norm last-layer hidden state of
every position in its KV cache, kept in step with verification (only the root and the accepted
path enter), handed to drafters as views; and, for drafters that declare `capture_layers`, the
target's intermediate layers at the same positions, captured by the model forward."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_llm_engine

from specserve.drafters.base import Drafter, register
from specserve.engine.features import FeatureStore
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.tree import NO_PARENT, TokenTree


def test_store_writes_views_and_rollback():
    store = FeatureStore(3, torch.float32)
    store.write(1, 0, torch.arange(12.).view(4, 3))
    assert store.length(1) == 4 and store.view(1, 1, 3).tolist() == [[3, 4, 5], [6, 7, 8]]
    store.write(1, 2, torch.full((3, 3), -1.))                     # rewrites from 2 on: 2..4
    assert store.length(1) == 5 and store.view(1)[:, 0].tolist() == [0, 3, -1, -1, -1]
    assert store.last(1)[0] == 4 and store.view(1, 3, 9) is None
    with pytest.raises(ValueError, match="jump"):
        store.write(1, 7, torch.zeros(1, 3))
    store.write(1, 0, torch.ones(100, 3))                          # a preempted sequence starts over (and grows)
    assert store.length(1) == 100 and bool((store.view(1) == 1).all())
    v = store.view(1, 0, 2)
    assert v.data_ptr() == store.view(1).data_ptr()                # a view, not a copy
    store.free(1)
    assert store.length(1) == 0 and store.last(1) is None


@pytest.mark.parametrize("capture", [(), (1, 3)])
def test_writes_of_several_sequences_at_once_equal_one_by_one(capture):
    """`write_many` (one multi-tensor copy) leaves the store as the same writes in turn would, growing
    buffers and rolling back alike; a sequence whose write leaves a gap is refused and untouched, the
    others still written."""
    g = torch.Generator().manual_seed(0)
    stores = [FeatureStore(3, torch.float32, capture_layers=capture) for _ in range(2)]

    def item(seq_id, start, n):
        layers = torch.randn(n, len(capture), 3, generator=g) if capture else None
        return seq_id, start, torch.randn(n, 3, generator=g), layers

    rounds = [[item(1, 0, 5), item(2, 0, 70), item(3, 0, 1)],
              [item(1, 5, 1), item(2, 68, 4), item(3, 1, 2)],      # 2 rolls back to 68 and grows past 64
              [item(1, 9, 1), item(3, 0, 3)]]                       # 1 would leave a gap: refused
    for items in rounds:
        refused = stores[1].write_many(items)
        for seq_id, start, hidden, layers in items:
            if start <= stores[0].length(seq_id):
                stores[0].write(seq_id, start, hidden, layers)
        assert refused == ([1] if items is rounds[2] else [])
    for seq_id in (1, 2, 3):
        assert stores[1].length(seq_id) == stores[0].length(seq_id)
        assert torch.equal(stores[1].view(seq_id), stores[0].view(seq_id))
        if capture:
            assert torch.equal(stores[1].layers_view(seq_id), stores[0].layers_view(seq_id))
    assert [stores[1].length(i) for i in (1, 2, 3)] == [6, 72, 3]


@register("test_features_reader")
class FeatureReader(Drafter):
    """Reads features; proposes the last tokens again under the root plus a random sibling branch,
    so verification accepts some paths and rejects others at varied node indices."""

    needs_features = True

    def __init__(self, ctx):
        self.ctx = ctx
        self.rng = random.Random(0)
        self.seen: list[int] = []

    def propose(self, seqs, budgets):
        trees = []
        for seq, budget in zip(seqs, budgets):
            self.seen.append(self.ctx.features.length(seq.seq_id))
            k = min(3, budget - 2)
            if k < 1:
                trees.append(None)
                continue
            noise = [self.rng.randrange(self.ctx.vocab_size) for _ in range(2)]
            cont = list(seq.token_ids[-4:-4 + k]) if len(seq.token_ids) > 4 else [seq.token_ids[-1]] * k
            tokens = [seq.token_ids[-1], noise[0], *cont, noise[1]]
            parents = [NO_PARENT, 0, 0, *range(2, 2 + k - 1), 1]
            trees.append(TokenTree(tokens, parents))
        return trees


def test_store_equals_a_fresh_forward_after_many_speculative_steps(tiny_llama_dir):
    import transformers

    engine = make_llm_engine(tiny_llama_dir, ["test_features_reader"])
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41, 42, 40, 41, 42, 40], [9, 10, 11, 12, 13]]
    params = [SamplingParams(temperature=0.0, max_tokens=140, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=140, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.0, max_tokens=140, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    for _ in range(25):
        engine.step()
    stats = engine.get_stats().drafters["test_features_reader"]
    assert stats.num_steps > 20 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    drafter = engine.drafters["test_features_reader"]
    assert drafter.ctx.features is engine.features and max(drafter.seen) > 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    assert len(seqs) == 3
    for seq in seqs:
        n = engine.features.length(seq.seq_id)
        assert n == seq.num_computed_tokens == len(seq.token_ids) - 1   # every KV position, the bonus has none yet
        with torch.no_grad():
            want = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(engine.features.view(seq.seq_id), want, atol=2e-4, rtol=1e-4)
    for r in list(engine.requests):
        engine.abort_request(r)
    engine.step()
    assert all(engine.features.length(s.seq_id) == 0 for s in seqs)   # freed with the sequence


# ---- intermediate layers (capture_layers) ----------------------------------------------------------


def test_store_keeps_captured_layers_in_step_with_the_features():
    store = FeatureStore(3, torch.float32, capture_layers=(4, 1, 4))
    assert store.capture_layers == (1, 4)                                  # sorted, once each
    hidden = torch.arange(12.).view(4, 3)
    layers = torch.arange(24.).view(4, 2, 3) + 100
    store.write(1, 0, hidden, layers)
    assert store.view(1, 1, 3, layer=4).tolist() == layers[1:3, 1].tolist()
    assert store.view(1, layer=1).tolist() == layers[:, 0].tolist()
    assert store.layers_view(1, 2).tolist() == layers[2:].tolist()
    assert store.layers_view(1, 0, 2).flatten(1).shape == (2, 6)           # EAGLE-3's concatenated input
    store.write(1, 2, torch.full((3, 3), -1.), torch.full((3, 2, 3), -2.))    # rollback to 2, then 2..4
    assert store.length(1) == 5
    assert store.view(1, layer=1)[:, 0].tolist() == [100, 106, -2, -2, -2]
    store.write(1, 0, torch.ones(100, 3), torch.zeros(100, 2, 3))          # preemption: from 0, and grows
    assert bool((store.layers_view(1) == 0).all()) and store.layers_view(1).shape == (100, 2, 3)
    v = store.view(1, 0, 2, layer=4)
    assert v.data_ptr() == store.layers_view(1)[0, 1].data_ptr()          # a view, not a copy
    store.truncate(1, 7)
    assert store.layers_view(1).shape[0] == 7 and store.view(1, 5, 9, layer=1) is None
    with pytest.raises(ValueError, match="needs them"):
        store.write(1, 7, torch.zeros(1, 3))
    with pytest.raises(KeyError, match="not captured"):
        store.view(1, layer=2)
    with pytest.raises(RuntimeError, match="empty"):
        store.set_capture_layers((2,))
    store.free(1)
    assert store.layers_view(1) is None and store.length(1) == 0
    plain = FeatureStore(3, torch.float32)
    with pytest.raises(ValueError, match="no intermediate layers"):
        plain.write(1, 0, torch.zeros(1, 3), torch.zeros(1, 1, 3))
    plain.write(1, 0, torch.zeros(2, 3))
    assert plain.layers_view(1) is None


@register("test_features_layers")
class LayerReader(FeatureReader):
    """FeatureReader that also asks for intermediate layers, computed from the target's depth in
    its constructor (as EAGLE-3's low/mid/high are): the embeddings and the last layer's output."""

    def __init__(self, ctx):
        super().__init__(ctx)
        self.capture_layers = (ctx.model_config.num_layers, 0)


@register("test_features_layers_mid")
class MidLayerReader(FeatureReader):
    capture_layers = (1,)


@register("test_features_layers_ignored")
class NotAReader(Drafter):
    """Declares layers without reading features: the engine ignores them."""

    capture_layers = (1,)

    def propose(self, seqs, budgets):
        return [None] * len(seqs)


def hf_layers(hf, tokens: list[int], layers) -> torch.Tensor:
    """transformers' hidden states after `k` decoder layers for each k of `layers` [n, len, H]; the
    last layer's output before the final norm (transformers' own last entry is after it) by a hook."""
    seen = {}
    handle = hf.model.layers[-1].register_forward_hook(
        lambda mod, args, out: seen.__setitem__("last", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    n_layers = len(hf.model.layers)
    return torch.stack([(seen["last"] if k == n_layers else states[k])[0] for k in layers], dim=1)


def test_captured_layers_equal_a_fresh_forward_after_speculation_and_preemption(tiny_llama_dir):
    import transformers

    engine = make_llm_engine(tiny_llama_dir, ["test_features_layers", "test_features_layers_mid",
                                              "test_features_layers_ignored"], num_kv_blocks=36, max_model_len=96)
    n_layers = engine.model_config.num_layers
    assert engine.features.capture_layers == tuple(range(n_layers + 1)) == engine.runner.capture_layers
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [40, 41, 42, 40, 41, 42, 40], [9, 10, 11, 12, 13]]
    params = [SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=80, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    steps = 0
    while engine.scheduler.num_preemptions == 0:
        engine.step()
        steps += 1
        assert steps < 200 and engine.has_unfinished_requests()
    from specserve.engine.sequence import SeqStatus

    victims = [s for r in engine.requests.values() for s in r.seqs if s.status is SeqStatus.WAITING]
    assert victims and victims[0].num_computed_tokens == 0
    victim, before = victims[0], len(victims[0].token_ids)
    # make room: the preempted sequence is recomputed from position 0 and speculates on
    engine.abort_request(next(r for r, req in engine.requests.items() if victim not in req.seqs))
    for _ in range(40):
        engine.step()
        if victim.status is SeqStatus.RUNNING and len(victim.token_ids) > before + 3:
            break
    assert victim.status is SeqStatus.RUNNING and len(victim.token_ids) > before + 3
    assert engine.has_unfinished_requests() and steps > 10
    stats = engine.get_stats().drafters["test_features_layers"]
    assert stats.num_steps > 10 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    checked = 0
    assert victim in seqs
    for seq in seqs:
        n = engine.features.length(seq.seq_id)
        assert n == seq.num_computed_tokens == len(seq.token_ids) - 1   # every KV position, the bonus has none yet
        checked += 1
        want = hf_layers(hf, seq.token_ids[:n], engine.features.capture_layers)
        torch.testing.assert_close(engine.features.layers_view(seq.seq_id), want, atol=2e-4, rtol=1e-4)
        for j, k in enumerate(engine.features.capture_layers):
            torch.testing.assert_close(engine.features.view(seq.seq_id, layer=k), want[:, j], atol=2e-4, rtol=1e-4)
        with torch.no_grad():
            last = hf(torch.tensor([seq.token_ids[:n]]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(engine.features.view(seq.seq_id), last, atol=2e-4, rtol=1e-4)
    assert checked >= 2
    for r in list(engine.requests):
        engine.abort_request(r)
    engine.step()
    assert len(engine.features) == 0


def test_without_capture_layers_nothing_extra_is_stored(tiny_llama_dir):
    engine = make_llm_engine(tiny_llama_dir, ["test_features_reader", "test_features_layers_ignored"])
    assert engine.features.capture_layers == () == engine.runner.capture_layers
    engine.add_request("a", [5, 6, 7, 8, 5, 6], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    for _ in range(4):
        engine.step()
    seq = engine.requests["a"].seqs[0]
    assert engine.features.length(seq.seq_id) > 0 and engine.features.layers_view(seq.seq_id) is None
    assert not engine.features._layers


def test_model_forward_with_and_without_capture(tiny_llama_dir):
    from specserve.engine.attention import build_attn_metadata
    from specserve.engine.kv_cache import KVCache

    engine = make_llm_engine(tiny_llama_dir, [])
    model, cfg = engine.model, engine.model_config
    tokens = [5, 6, 7, 8, 9, 10, 11, 3, 2]

    def run(capture):
        cache = KVCache(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        positions, meta = build_attn_metadata([[0, 1, 2, 3]], 4, [0], [len(tokens)], None, "cpu")
        with torch.inference_mode():
            return model(torch.tensor(tokens), positions, cache, meta, capture), cache

    plain, cache_a = run(())
    (hidden, captured), cache_b = run((2, 0, 1))
    assert torch.equal(model.compute_logits(plain), model.compute_logits(hidden))
    assert torch.equal(cache_a.kv, cache_b.kv)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    torch.testing.assert_close(captured, hf_layers(hf, tokens, (2, 0, 1)), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="must be in 0..2"):
        run((3,))
    with pytest.raises(ValueError, match="repeat"):
        run((1, 1))

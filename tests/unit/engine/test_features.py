"""The engine-owned feature store: per sequence, the target's post-norm last-layer hidden state of
every position in its KV cache, kept in step with verification (only the root and the accepted
path enter), handed to drafters as views."""

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
